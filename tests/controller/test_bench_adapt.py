"""``vigil bench adapt``'s pieces without a cluster: the job each run submits (valid, the policy and the adapted
setting per run), the steps a run lost to a restart, and the command line refusing an unknown run. The real
run is in docs/BENCHMARKS.md."""

from __future__ import annotations

import pytest

from ops.bench import adapt as bench
from vigil.contract.schemas import RecoveryPolicy, adapted_params


@pytest.mark.parametrize("run", bench.RUNS)
def test_each_run_submits_the_same_job_under_its_policy(run: str) -> None:
    spec = bench.job_spec("x", bench.POLICY[run])
    assert spec.optimizer.kind == "dsm" and spec.optimizer.params == {"tau": bench.TAU}
    assert spec.recovery.policy == RecoveryPolicy(bench.POLICY[run])
    if run == "adapt":
        assert spec.recovery.adapt is not None
        assert adapted_params(spec, spec.recovery.adapt.params).tau == bench.ADAPT_TAU > bench.TAU
    else:
        assert spec.recovery.adapt is None
    assert spec.steps % spec.checkpoint.interval_steps == 0 and bench.AT % spec.checkpoint.interval_steps == 0


def test_steps_lost_are_those_run_twice_after_a_restart() -> None:
    steps = [*range(1, 61), *range(41, 101)]  # resumed from the step-40 checkpoint
    ts = [float(i) for i in range(60)] + [70.0 + i for i in range(60)]
    acted = [{"acted_at": "2026-01-01T00:00:00", "step_at_detect": 58}]
    assert bench._steps_lost(steps, ts, acted) == 58 - 40
    assert bench._steps_lost(steps, ts, [{"acted_at": None, "step_at_detect": 58}]) == 0  # no restart asked
    assert bench._wall(steps, ts) == 129.0 and bench._wall([], []) is None


def test_an_unknown_run_is_refused_before_any_cluster_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--runs", "adapt,bogus"])
    assert "--runs: unknown ['bogus']" in capsys.readouterr().err
