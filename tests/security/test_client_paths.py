"""The typed client, as an attacker who controls an id would use it: the dashboard passes ids from its
URL (``/dashboard/compare?jobs=...``), the CLI from its arguments, the agents from the controller. httpx
resolves dot segments, so ``get_job("../tokens")`` would ask ``GET /api/v1/tokens`` with the client's
token; a ``?`` or ``#`` would cut the route short. The client refuses such a path before sending
anything, and every ordinary id still reaches its own route."""

from __future__ import annotations

import httpx
import pytest

from vigil.contract.client import ApiError, VigilClient


def _client(seen: list[str]) -> VigilClient:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.raw_path.decode()}")
        return httpx.Response(404, json={"detail": "no such job"})

    return VigilClient("http://controller.test", token="t", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("bad", ["..", ".", "../tokens", "../../api/v1/tokens", "x/../../tokens", "a?limit=1",
                                 "a#frag", "./a"])
def test_an_id_that_would_bend_the_path_is_refused_and_nothing_is_sent(bad: str) -> None:
    seen: list[str] = []
    with _client(seen) as client:
        for call in (lambda: client.get_job(bad), lambda: client.cancel_job(bad), lambda: client.job_metrics(bad),
                     lambda: client.evict_node(bad), lambda: client.revoke_token(bad)):
            with pytest.raises(ApiError) as exc:
                call()
            assert exc.value.status_code == 400 and "refused to send" in str(exc.value)
    assert seen == []


def test_ordinary_ids_reach_their_own_routes() -> None:
    seen: list[str] = []
    with _client(seen) as client:
        for job_id in ("job_0123abcd", "a.b", "..a", "node-1:8080"):
            with pytest.raises(ApiError) as exc:
                client.get_job(job_id)
            assert exc.value.status_code == 404  # the server's answer: the request went out
    assert seen == ["GET /api/v1/jobs/job_0123abcd", "GET /api/v1/jobs/a.b", "GET /api/v1/jobs/..a",
                    "GET /api/v1/jobs/node-1:8080"]
