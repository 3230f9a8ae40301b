"""Fuzz the REST API from its own OpenAPI description (schemathesis): no input may cause a 5xx.

Every operation gets schema-conforming (positive) and schema-violating (negative) requests, sent
in-process to the ASGI app with an admin token, on SQLite and on PostgreSQL (which refuses what
SQLite lets through: NUL in text, NaN in JSON), and SQLite refuses integers beyond 64 bits. Bounded:
at most a fixed number of examples per operation, no shrinking, and an equal share of a wall-clock
budget per operation, past which an operation stops once it has had its minimum of examples.

Needs: schemathesis (the ``test`` extra); PostgreSQL on 127.0.0.1:5432 for the postgresql case.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.schemas import APIOperation

from tests.auth import bearer, issue_token
from tests.harness import build_app, settings_for

EXAMPLES = {GenerationMode.POSITIVE: 100, GenerationMode.NEGATIVE: 30}
BUDGET_S = 25.0
"""Per database, shared equally between the operations."""
MIN_EXAMPLES = 5
"""Each operation gets at least these of each kind (positive, negative), however slow the machine."""


class _OutOfTime(Exception):
    """Ends one operation's run once its share of the budget is spent."""

pytestmark = pytest.mark.timeout(300)


def test_openapi_fuzz_finds_no_server_error(db_url: str, tmp_path: Path) -> None:
    app = build_app(settings_for(tmp_path, db_url, max_body_bytes=256 * 1024))
    headers = bearer(issue_token(app, "admin"))
    schema = schemathesis.openapi.from_asgi("/api/v1/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    share = BUDGET_S / len(operations)
    failures: list[str] = []
    sent: dict[tuple[str, GenerationMode], int] = {}

    def run(operation: APIOperation, mode: GenerationMode, examples: int, deadline: float) -> None:
        # derandomize: the same examples every run, so a failure is reproducible, never a fluke.
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case: schemathesis.Case) -> None:
            key = (operation.label, mode)
            if time.monotonic() > deadline and sent.get(key, 0) >= MIN_EXAMPLES:
                raise _OutOfTime
            response = case.call(headers=headers)  # an exception in the app fails the test too
            sent[key] = sent.get(key, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{response.status_code} from {case.as_curl_command()}\n    {response.text[:300]}")

        fuzz()

    try:
        for operation in operations:
            for mode, examples in EXAMPLES.items():
                try:
                    run(operation, mode, examples, time.monotonic() + share / len(EXAMPLES))
                except _OutOfTime:
                    pass
    finally:
        app.state.engine.dispose()
    assert failures == [], f"{len(failures)} server errors:\n" + "\n".join(failures[:20])
    hardly = {k: n for k, n in sent.items() if n < MIN_EXAMPLES}
    assert len(sent) == len(operations) * len(EXAMPLES) and not hardly, f"operations hardly fuzzed: {hardly}"
