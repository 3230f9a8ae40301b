"""``optimizer.params`` validated with the job spec (vigil/contract/optimizer_params.py): unit tests of the
parse, and the REST API refusing bad params with 422 before anything is stored.

Needs: nothing outside this process (the API tests use SQLite and a fake launcher; no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, select

from controller.models import Event, Job
from tests.harness import build_app, in_process, settings_for
from vigil.contract.optimizer_params import (
    KIND_DEFAULTS,
    PARAMS_BY_KIND,
    SDP4BIT_VARIANTS,
    CSERParams,
    DSMParams,
    SDP4BitParams,
    parse_optimizer_params,
)
from vigil.contract.schemas import OptimizerKind, OptimizerSpec

API = "/api/v1"

# (kind, params, the field the message must name): each refused at submission.
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("sdp4bit", {"bits": 99}, "bits"),  # SDP4Bit has no bits: an unknown name
    ("sdp4bit", {"hadamard_order": 24}, "hadamard_order"),
    ("sdp4bit_ulq", {"grads": "tlq_x"}, "grads"),
    ("dsm", {"tau": 0}, "tau"),
    ("dsm", {"tau": "twelve"}, "tau"),  # a string for a number
    ("dsm", {"sharded": 1}, "sharded"),  # a number for a bool
    ("dsm", {"tua": 3}, "tua"),  # unknown name
    ("slowmo", {"tau": True}, "tau"),  # a bool for an int
    ("powersgd", {"rank": 1.5}, "rank"),  # a fractional float for an int
    ("compressed_adam", {"compressor": "twobit"}, "compressor"),
    ("cser_pl", {"rc1": 4}, "rc1"),  # cser_pl pins rc1 = 0
    ("adamw", {"tau": 3}, "tau"),  # adamw takes no params: refused, not ignored
]
IDS = [f"{k}-{'-'.join(f'{n}={v}' for n, v in p.items())}" for k, p, _ in BAD]


# --------------------------------------------------------------------------------------------------
# unit


def test_every_kind_has_a_params_class() -> None:
    assert set(PARAMS_BY_KIND) == set(get_args(OptimizerKind))


@pytest.mark.parametrize("kind", sorted(PARAMS_BY_KIND))
def test_defaults_parse(kind: str) -> None:
    typed = OptimizerSpec(kind=kind).typed_params()  # type: ignore[arg-type]
    cls = PARAMS_BY_KIND[kind]
    assert type(typed) is cls
    expected = {f.name: f.default for f in dataclasses.fields(cls)} | KIND_DEFAULTS.get(kind, {})
    if kind == "cser_pl":
        expected["rc1"] = 0
    assert dataclasses.asdict(typed) == expected


def test_kind_specific_defaults() -> None:
    for kind, (weights, grads) in SDP4BIT_VARIANTS.items():
        cfg = parse_optimizer_params(kind, {})
        assert isinstance(cfg, SDP4BitParams) and (cfg.weights, cfg.grads) == (weights, grads), kind
    # The ablation's defaults yield to what the spec says.
    assert parse_optimizer_params("sdp4bit_qw", {"weights": "fp32"}) == SDP4BitParams(weights="fp32", grads="fp32")
    assert parse_optimizer_params("cser_pl", {"rc1": 0, "H": 3}) == CSERParams(rc1=0, H=3)


def test_values_are_typed() -> None:
    spec = OptimizerSpec(kind="dsm", params={"tau": 3.0, "gamma": 2, "sign": "randomized"})
    cfg = spec.typed_params(DSMParams)
    assert cfg == DSMParams(tau=3, gamma=2.0, sign="randomized")
    assert isinstance(cfg.tau, int) and isinstance(cfg.gamma, float)
    assert spec.params == {"tau": 3.0, "gamma": 2, "sign": "randomized"}  # stored as given
    with pytest.raises(TypeError, match="takes DSMParams, not SDP4BitParams"):
        spec.typed_params(SDP4BitParams)


@pytest.mark.parametrize(("kind", "params", "field"), BAD, ids=IDS)
def test_bad_params_are_refused_naming_the_field(kind: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"optimizer\.params\.{field} \({kind}\): "):
        parse_optimizer_params(kind, params)
    with pytest.raises(ValidationError, match=rf"optimizer\.params\.{field} \({kind}\): "):
        OptimizerSpec(kind=kind, params=params)  # type: ignore[arg-type]


def test_messages_say_the_rule() -> None:
    def message(kind: str, params: dict[str, Any]) -> str:
        with pytest.raises(ValueError) as info:
            parse_optimizer_params(kind, params)
        return str(info.value)

    assert message("dsm", {"tau": 0}) == "optimizer.params.tau (dsm): must be >= 1, got 0"
    assert message("dsm", {"tau": "twelve"}) == "optimizer.params.tau (dsm): expected int, got 'twelve'"
    assert message("slowmo", {"tau": True}) == "optimizer.params.tau (slowmo): expected int, got True"
    assert message("sdp4bit", {"bits": 99}).startswith("optimizer.params.bits (sdp4bit): unknown parameter; accepted: [")
    assert message("adamw", {"x": 1}) == "optimizer.params.x (adamw): unknown parameter; it takes no params"


# --------------------------------------------------------------------------------------------------
# API (SQLite, fake launcher)


@pytest.fixture
def client(sqlite_url: str, tmp_path: Path) -> Iterator[TestClient]:
    with in_process(build_app(settings_for(tmp_path, sqlite_url))) as c:
        yield c


def _count(client: TestClient, model: type) -> int:
    with client.app.state.sessions() as s:
        return s.scalar(select(func.count()).select_from(model))


def _job(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"name": f"params-{kind}", "steps": 10, "optimizer": {"kind": kind, "params": params}}


@pytest.mark.parametrize(("kind", "params", "field"), BAD, ids=IDS)
def test_api_refuses_bad_params_with_422_and_stores_nothing(client: TestClient, kind: str, params: dict[str, Any],
                                                            field: str) -> None:
    before = client.get(f"{API}/jobs").json()
    r = client.post(f"{API}/jobs", json=_job(kind, params))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any("optimizer" in map(str, d["loc"]) and f"optimizer.params.{field} ({kind})" in d["msg"]
               for d in detail), detail
    assert client.get(f"{API}/jobs").json() == before
    assert _count(client, Job) == 0 and _count(client, Event) == 0


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("sdp4bit", {}),
        ("sdp4bit", {"ranks_per_node": 2, "weights": "fp32", "grads": "fp32", "seed": 3}),
        ("sdp4bit_ulq", {"grad_group": 64, "hadamard_order": 16}),
        ("dsm", {"tau": 3, "sign": "randomized", "sharded": False}),
        ("dsm", {"gamma": 4}),
    ],
)
def test_api_accepts_good_params(client: TestClient, kind: str, params: dict[str, Any]) -> None:
    r = client.post(f"{API}/jobs", json=_job(kind, params))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["spec"]["optimizer"] == {**job["spec"]["optimizer"], "kind": kind, "params": params}
    listed = client.get(f"{API}/jobs").json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == job["id"]


def test_a_job_stored_before_params_were_checked_still_lists(client: TestClient) -> None:
    """Rows written before this check (adamw with a stray ``tau`` ran then) still read back; the check
    is at submission."""
    r = client.post(f"{API}/jobs", json=_job("adamw", {}))
    assert r.status_code == 201
    job_id = r.json()["id"]
    with client.app.state.sessions() as s:
        row = s.get(Job, job_id)
        row.spec = {**row.spec, "optimizer": {**row.spec["optimizer"], "params": {"tau": 12}}}
        s.commit()
    assert client.get(f"{API}/jobs/{job_id}").json()["spec"]["optimizer"]["params"] == {"tau": 12}
    assert client.get(f"{API}/jobs").json()["count"] == 1
    client.app.state.supervisor.step()  # launching it does not raise either (the ranks refuse it, as before)
    with pytest.raises(ValidationError, match=r"optimizer.params.tau \(adamw\)"):
        OptimizerSpec.model_validate({"kind": "adamw", "params": {"tau": 12}})
