"""The argument model of each command kind, validated at the edge: a bad one is an answer with
``ok=false`` (:func:`_validate` turns pydantic's errors into a :class:`CommandError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.commands.errors import CommandError
from vigil.contract.schemas import INT32_MAX


class _Args(BaseModel):
    # Extra keys are ignored: the controller may add context (job id, rank) for its own records.
    model_config = ConfigDict(extra="ignore")


class PidArgs(_Args):
    pid: int = Field(..., ge=2, le=INT32_MAX)


class KillArgs(PidArgs):
    signal: int | str = Field("SIGKILL", description="Name (SIGKILL, KILL) or number; default SIGKILL.")


class ThrottleArgs(PidArgs):
    factor: float = Field(3.0, ge=1.0, le=1000.0, description="The process runs 1/factor of each period.")
    period_s: float = Field(0.1, ge=0.01, le=10.0, description="Length of one run/stop cycle.")


class FaultFileArgs(_Args):
    job_id: str = Field(..., min_length=1, max_length=128)
    rank: int = Field(..., ge=0, le=1_000_000)
    fault: dict[str, Any] = Field(default_factory=dict)
    file: Literal["fault", "adapt"] = Field("fault", description="fault: the one-shot fault file; adapt: the rank's "
                                            "adapt file (recovery.policy adapt), which holds every version asked for")


class CorruptArgs(_Args):
    path: str = Field(..., min_length=1, max_length=4096)
    newest_under: bool = Field(False, description="path is a folder of checkpoints: corrupt the newest complete one "
                                                   "(the highest-numbered subfolder holding a manifest) as storage "
                                                   "has it now, which the controller may not have heard of yet.")


class PyspyArgs(_Args):
    job_id: str = Field("", max_length=128)
    pids: dict[int, int] = Field(..., max_length=4096, description="rank -> pid")


def _validate(model: type[_Args], args: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(dict(args))
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        what = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errs[:5])
        raise CommandError(f"bad args: {what}") from None
