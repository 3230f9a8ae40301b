"""Each fault kind's ``params``, typed and ranged (``POST /jobs/{id}/faults``).

A fault's parameters reach the monitor (which turns them into agent commands every pass) and the agents
(``tc`` and signal duty cycles): a value of the wrong type or out of range once stopped every monitor pass
of the whole cluster. So every kind lists the parameters it takes, each with its type and range; anything
else (an unknown name, a string where a number goes, a number out of range) is refused with a 422 naming
``params.<name>`` and the rule, and nothing is stored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _FaultParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class NoParams(_FaultParams):
    """The kind takes no parameters."""


class ProcessParams(_FaultParams):
    """kill_rank, hang_rank."""

    mode: Literal["rank", "agent"] = "rank"


class SlowRankParams(_FaultParams):
    factor: float = Field(3.0, gt=1.0, le=100.0, description="How many times slower (above 1, at most 100).")
    mode: Literal["throttle", "compute", "comm"] = "throttle"
    period_s: float = Field(0.02, ge=0.005, le=10.0, description="throttle's stop/run cycle, seconds.")


class DegradeNicParams(_FaultParams):
    fraction: float = Field(0.25, gt=0.0, le=1.0, description="The link's rate times this.")


class NicLatencyParams(_FaultParams):
    delay_ms: float = Field(10.0, ge=0.0, le=10_000.0)
    jitter_ms: float = Field(0.0, ge=0.0, le=10_000.0)


class NicLossParams(_FaultParams):
    percent: float = Field(1.0, ge=0.0, le=100.0)


class FlapNicParams(_FaultParams):
    seconds: float = Field(2.0, gt=0.0, le=600.0, description="Link down this long each time.")
    times: int = Field(1, ge=1, le=100)
    up_s: float = Field(2.0, gt=0.0, le=600.0, description="Link up this long between two downs.")


class PartitionParams(_FaultParams):
    seconds: float = Field(30.0, gt=0.0, le=3600.0, description="Lifted by the agent itself after this long.")


FAULT_PARAMS: dict[str, type[_FaultParams]] = {
    # by FaultKind's value (vigil.contract.schemas.recovery imports this module)
    "kill_rank": ProcessParams,
    "hang_rank": ProcessParams,
    "slow_rank": SlowRankParams,
    "nan_loss": NoParams,
    "kill_node": NoParams,
    "corrupt_checkpoint": NoParams,
    "degrade_nic": DegradeNicParams,
    "nic_latency": NicLatencyParams,
    "nic_loss": NicLossParams,
    "flap_nic": FlapNicParams,
    "partition_node": PartitionParams,
}


def check_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` of a ``kind`` fault as given (ints where a float goes become floats), or ValueError naming
    ``params.<name>`` and the rule. Only the names given are kept: the defaults stay the code's."""
    model = FAULT_PARAMS[kind]
    try:
        # strict refuses "3" for a number; an int for a float field is fine in strict mode.
        parsed = model.model_validate(params)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"]) or "params"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(model.model_fields) or "none"
            msg = f"{kind} takes no parameter {where!r} (its parameters: {allowed})"
        raise ValueError(f"params.{where}: {msg}") from None
    return parsed.model_dump(include=set(params))
