"""A client reads a newer controller's answers: unknown fields are dropped and named once; other errors raise."""

from __future__ import annotations

import copy
import json
import logging
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from vigil.contract.client import VigilClient
from vigil.contract.lenient import parse
from vigil.contract.schemas import JobCreate, JobPublic, JobsPublic

JOB = JobPublic(id="j1", name="n", status="RUNNING", created_at=datetime(2026, 11, 28, tzinfo=UTC),
                spec=JobCreate(name="n")).model_dump(mode="json")


def _client(answer: dict[str, Any]) -> VigilClient:
    return VigilClient("http://controller", transport=httpx.MockTransport(
        lambda req: httpx.Response(200, content=json.dumps(answer).encode(), headers={"content-type": "application/json"})))


def test_a_newer_controllers_fields_are_dropped_and_named_once(caplog: pytest.LogCaptureFixture) -> None:
    newer = copy.deepcopy(JOB)
    newer["spec"]["recovery"]["standby_pool"] = 2  # a spec field this client does not know
    newer["queue_position"] = 4  # and a field of the job itself (ignored by the model already)
    caplog.set_level(logging.WARNING, logger="vigil.contract.lenient")
    with _client(newer) as c:
        job = c.get_job("j1")
        assert job.id == "j1" and job.spec.recovery.policy.value == "evict_restart"
        assert not hasattr(job.spec.recovery, "standby_pool")
        c.get_job("j1")
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "JobPublic.spec.recovery.standby_pool" in named[0], named  # once, not per call
    # In a list, every item's unknown field goes.
    listed = parse(JobsPublic, {"data": [copy.deepcopy(newer), copy.deepcopy(newer)], "count": 2})
    assert [j.id for j in listed.data] == ["j1", "j1"]


def test_anything_else_wrong_still_raises() -> None:
    bad = copy.deepcopy(JOB)
    bad["spec"]["steps"] = "many"
    with pytest.raises(ValidationError, match="steps"):
        parse(JobPublic, bad)
    both = copy.deepcopy(bad)
    both["spec"]["recovery"]["standby_pool"] = 2  # an unknown field does not hide a wrong one
    with pytest.raises(ValidationError, match="steps"):
        parse(JobPublic, both)
    # What a controller is sent stays strict: a misspelt spec field is refused, naming it.
    with pytest.raises(ValidationError, match="standby_pool"):
        JobCreate.model_validate({"name": "n", "recovery": {"standby_pool": 2}})
