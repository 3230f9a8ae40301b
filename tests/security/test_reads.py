"""Attacks on the reads: a job's own output is untrusted and unbounded; what the API returns of it is not.

Finding (issue 23): ``/jobs/{id}/logs`` returned the whole driver log, whose size the job's code decides (a
job printing 40 MB made every read of its log move 40 MB through the controller and the dashboard). The
controller is the real app and database; Ray's job log is played by the test's launcher."""

from __future__ import annotations

from tests.controller.recovery_env import API, Env
from vigil.contract.schemas import LOG_TAIL_DEFAULT, LOG_TAIL_MAX


def test_a_huge_driver_log_is_read_by_its_tail_from_a_line_start(env: Env) -> None:
    line = "step 123 loss 0.5 " * 4 + "\n"
    big = "x" * 10 + "\n" + line * (40 * 1024 * 1024 // len(line)) + "the last line\n"
    env.launcher.log_text[f"fake-{env.job_id}"] = big
    r = env.client.get(f"{API}/jobs/{env.job_id}/logs")
    assert r.status_code == 200
    out = r.json()
    assert out["truncated"] is True and out["total_bytes"] == len(big.encode())
    assert len(out["logs"].encode()) <= LOG_TAIL_DEFAULT and out["logs"].endswith("the last line\n")
    assert out["logs"].startswith("step 123")  # cut where a line starts, not mid-line
    small = env.client.get(f"{API}/jobs/{env.job_id}/logs", params={"tail_bytes": 1000}).json()
    assert len(small["logs"].encode()) <= 1000 and small["logs"].endswith("the last line\n")
    r = env.client.get(f"{API}/jobs/{env.job_id}/logs", params={"tail_bytes": LOG_TAIL_MAX + 1})
    assert r.status_code == 422 and "tail_bytes" in r.text


def test_a_short_log_comes_whole(env: Env) -> None:
    env.launcher.log_text[f"fake-{env.job_id}"] = "one\ntwo\n"
    out = env.client.get(f"{API}/jobs/{env.job_id}/logs").json()
    assert (out["logs"], out["truncated"], out["total_bytes"]) == ("one\ntwo\n", False, 8)


def test_a_read_of_steps_loads_a_bounded_number_of_rows(env: Env, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``/steps`` used to load every row of every rank before thinning: a long job of many ranks made one read
    cost the controller gigabytes. Here the budget is made small to see the bound at work."""
    from controller import series

    env.steps(1, 200)
    env.client.app.state.telemetry.flush()
    whole = env.client.get(f"{API}/jobs/{env.job_id}/steps").json()
    assert [len(d["step"]) for d in whole["data"]] == [200, 200]
    monkeypatch.setattr(series, "ROW_BUDGET", 100)  # 2 ranks x 200 steps: every 4th step
    bounded = env.client.get(f"{API}/jobs/{env.job_id}/steps").json()
    assert bounded["count"] == 2
    for d in bounded["data"]:
        assert d["step"][0] == 1 and d["step"][-1] == 200 and len(d["step"]) <= 100 // 2 + 1, d["step"]
        assert all((s - 1) % 4 == 0 for s in d["step"][:-1]), d["step"]
    one = env.client.get(f"{API}/jobs/{env.job_id}/steps", params={"max_ranks": 1}).json()
    assert one["count"] == 2 and [d["rank"] for d in one["data"]] == [0]
