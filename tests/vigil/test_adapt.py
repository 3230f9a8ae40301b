"""``recovery.policy: adapt`` on one rank: the adapt file hook (vigil/rank/adapt.py), the strategies' new
``reconfigure`` and sync schedule (vigil/optim/local.py), and a world-of-one session that takes a version.

Single process, no process group (a world of one's collectives run locally and are still recorded), files
under pytest's tmp_path. The 2-rank agreement is tests/vigil/test_adapt_ranks.py.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.vigil.optim.common import make, tiny_mlp, train_step
from tests.vigil.telemetry_sink import FaultSink
from vigil import sdk as vigil
from vigil.comm import Comm
from vigil.contract.optimizer_params import DSMParams, LocalAdamWParams, SlowMoParams
from vigil.contract.schemas import JobCreate
from vigil.contract.settings import adapt_file_path, fault_file_path
from vigil.optim.local import PeriodicAveraging
from vigil.rank.adapt import ADAPT_TAG, AdaptHook, adapt_path, parse_versions


def _write(path: Path, body: Any) -> None:
    """As the agent does: a whole file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(body if isinstance(body, str) else json.dumps(body))
    os.replace(tmp, path)


def _versions(*entries: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    return {"versions": [{"version": v, "params": p} for v, p in entries]}


# -- the hook ----------------------------------------------------------------------------------------


def test_the_adapt_file_sits_beside_the_fault_file(tmp_path: Path) -> None:
    fault = fault_file_path(tmp_path, "job-a", 3)
    assert adapt_path(fault, "job-a", 3) == adapt_file_path(tmp_path, "job-a", 3)
    assert adapt_path(None, "job-a", 3) is None


def test_the_hook_reads_every_version_and_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.adapt.json"
    hook = AdaptHook(path)
    hook.poll()  # no file yet
    assert (hook.versions, hook.newest) == ({}, 0)
    _write(path, _versions((1, {"tau": 48})))
    hook.poll()
    assert (hook.versions, hook.newest) == ({1: {"tau": 48}}, 1)
    _write(path, _versions((1, {"tau": 48}), (2, {})))
    hook.poll()
    assert (hook.versions, hook.newest) == ({1: {"tau": 48}, 2: {}}, 2)
    path.unlink()  # a removed file takes nothing back
    hook.poll()
    assert hook.newest == 2 and AdaptHook(None).newest == 0


def test_a_malformed_file_is_ignored_until_it_is_fixed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rank-1.adapt.json"
    hook = AdaptHook(path)
    _write(path, _versions((1, {"tau": 48})))
    hook.poll()
    for bad in ("{not json", {"versions": {}}, [1], _versions((2, {}), (2, {"tau": 5})), _versions((0, {})),
                {"versions": [{"version": True, "params": {}}]}, {"versions": [{"version": 3, "params": [1]}]}):
        _write(path, bad)
        with caplog.at_level(logging.WARNING, logger="vigil.rank.adapt"):
            caplog.clear()
            hook.poll()
            hook.poll()  # unchanged: not read (nor logged) again
        assert len([r for r in caplog.records if "ignoring adapt file" in r.getMessage()]) == 1, bad
        assert hook.versions == {1: {"tau": 48}}, bad
    _write(path, _versions((1, {"tau": 48}), (3, {})))
    hook.poll()
    assert hook.newest == 3 and hook.versions[3] == {}


def test_parse_versions_names_what_is_wrong() -> None:
    assert parse_versions(_versions((1, {"tau": 4}), (5, {}))) == {1: {"tau": 4}, 5: {}}
    with pytest.raises(ValueError, match=r"versions\[1\].version: 1 after 2"):
        parse_versions(_versions((2, {}), (1, {})))
    with pytest.raises(TypeError, match=r"versions\[0\].params"):
        parse_versions({"versions": [{"version": 1}]})


# -- the strategies ----------------------------------------------------------------------------------


def _sync_steps(strategy: Any, steps: range) -> list[int]:
    synced = []
    for step in steps:
        before = strategy.comm.drain()
        assert not [r for r in before if r.tag == "sync"]
        train_step(strategy, 0, step)
        if any(r.tag == "sync" for r in strategy.comm.drain()):
            synced.append(step)
    return synced


@pytest.mark.parametrize("kind", ["local_adamw", "slowmo", "dsm"])
def test_an_unchanged_tau_syncs_at_its_multiples_as_before(kind: str) -> None:
    strategy = make(kind, tiny_mlp(), Comm(), tau=4)
    assert _sync_steps(strategy, range(1, 26)) == [s for s in range(1, 26) if s % 4 == 0]
    # A restore mid-period keeps the old phase: the next sync at the next multiple of tau.
    state = strategy.state_dict()
    state["local_steps"] = 30
    restored = make(kind, tiny_mlp(), Comm(), tau=4)
    restored.load_state_dict(state)
    assert isinstance(restored, PeriodicAveraging) and restored.last_sync == 28
    assert _sync_steps(restored, range(31, 40)) == [32, 36]


def test_a_tau_changed_mid_period_counts_from_the_last_sync() -> None:
    strategy = make("local_adamw", tiny_mlp(), Comm(), tau=4)
    assert _sync_steps(strategy, range(1, 7)) == [4]
    strategy.reconfigure(LocalAdamWParams(tau=7))  # 2 of 7 steps done since the sync at 4
    assert _sync_steps(strategy, range(7, 20)) == [11, 18]
    strategy.reconfigure(LocalAdamWParams(tau=2))  # 1 step since 18: one more to go
    assert _sync_steps(strategy, range(20, 24)) == [20, 22]
    strategy.reconfigure(LocalAdamWParams(tau=7))
    assert _sync_steps(strategy, range(24, 26)) == []
    strategy.reconfigure(LocalAdamWParams(tau=1))  # the shorter period is over already: sync next step
    assert _sync_steps(strategy, range(26, 28)) == [26, 27]
    assert strategy.tau == 1 and strategy.config == LocalAdamWParams(tau=1)


def test_reconfigure_takes_only_tau_of_its_own_kind() -> None:
    slowmo = make("slowmo", tiny_mlp(), Comm(), tau=4)
    slowmo.reconfigure(SlowMoParams(tau=9))
    assert slowmo.tau == 9
    with pytest.raises(ValueError, match=r"only tau can change while it runs, not \['beta'\]"):
        slowmo.reconfigure(SlowMoParams(tau=9, beta=0.1))
    with pytest.raises(ValueError, match="expected SlowMoParams, got DSMParams"):
        slowmo.reconfigure(DSMParams(tau=9))
    assert slowmo.tau == 9


@pytest.mark.parametrize("kind", ["adamw", "cser", "sdp4bit"])
def test_a_strategy_that_cannot_reconfigure_says_which(kind: str) -> None:
    strategy = make(kind, tiny_mlp(), Comm())
    with pytest.raises(NotImplementedError, match=type(strategy).__name__):
        strategy.reconfigure(LocalAdamWParams(tau=48))


# -- a session of one ----------------------------------------------------------------------------------


def _spec(policy: str = "adapt", **recovery: Any) -> JobCreate:
    if policy == "adapt":
        recovery.setdefault("adapt", {"params": {"tau": 6}})
    return JobCreate.model_validate({
        "name": "adapt", "steps": 12, "checkpoint": {"interval_steps": 5},
        "optimizer": {"kind": "local_adamw", "lr": 1e-2, "params": {"tau": 2}},
        "recovery": {"policy": policy, **recovery}})


def _loop(steps: int, taus: dict[int, int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = vigil.optimizer(model)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        with vigil.step(step) as s:
            x = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(opt.model(x), x[:, :1])
            loss.backward()
            opt.step()
            s.report(loss)
        taus[step] = opt.strategy.tau  # type: ignore[attr-defined]


def test_a_restarted_rank_takes_the_files_newest_version_at_its_first_step(tmp_path: Path) -> None:
    fault = fault_file_path(tmp_path, "job-one", 0)
    _write(adapt_file_path(tmp_path, "job-one", 0), _versions((1, {"tau": 6}), (2, {}), (3, {"tau": 3})))
    sink, taus = FaultSink(), {}
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-one", telemetry=sink, fault_file=fault)
    vigil.run(lambda cfg: _loop(12, taus), ctx, _spec())
    assert [(f.fault_kind, f.fault_id, f.step) for f in sink.faults] == [("adapt", 3, 1)]
    assert taus == dict.fromkeys(range(1, 13), 3)
    adapt_steps = [r.step for recs in sink.records for r in recs if r.tag == ADAPT_TAG]
    assert adapt_steps == [1, 1, 5, 10]  # the first step (agreement + params check), then each boundary
    first = sink.steps[0]
    assert first.optim_s is not None and first.comm_s is not None  # its collectives ran in its optimizer phase


def test_a_job_without_policy_adapt_never_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fault = fault_file_path(tmp_path, "job-plain", 0)
    adapt_file = adapt_file_path(tmp_path, "job-plain", 0)
    _write(adapt_file, _versions((1, {"tau": 6})))
    looked: list[str] = []
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        looked.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr("vigil.rank.adapt.os.stat", stat)
    sink, taus, sessions = FaultSink(), {}, []
    ctx = vigil.RankContext(rank=0, world_size=1, job_id="job-plain", telemetry=sink, fault_file=fault)
    vigil.run(lambda cfg: (sessions.append(vigil.get_session()), _loop(12, taus)), ctx, _spec("evict_restart"))
    assert sessions[0].adapt is None and str(adapt_file) not in looked
    assert str(fault) in looked  # the patch does see the rank's stat calls
    assert not [r for recs in sink.records for r in recs if r.tag == ADAPT_TAG]
    assert sink.faults == [] and set(taus.values()) == {2}
