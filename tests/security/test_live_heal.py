"""Attacks on a live job's replicas through torchft's lighthouse and heal transport (vigil.live_trust).

torchft's lighthouse takes no credential, so anything that reaches it can join a job's quorums. On torchft's
own transport a member that claims a higher step becomes the recovery source of every replica behind it and
its pickle runs in them, and every replica's heal server hands its whole state to anyone. Here: a real
lighthouse, real Vigil replicas (:class:`vigil.live.LiveReplica`, as a job's actor builds them) and an
attacker that is a real torchft Manager, or plain HTTP requests.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import threading
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from vigil.live import LiveReplica, start_lighthouse
from vigil.live_trust import (
    MAC_HEADER,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    ForeignQuorum,
    HealRefused,
    SignedHTTPTransport,
    foreign_members,
    new_key,
)

TIMEOUT = timedelta(seconds=5)


class _Payload:
    """What the attacker's state holds: unpickling it creates a file (its code ran in the victim)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.marker), "w")


def _evil_server(body: bytes) -> ThreadingHTTPServer:
    """An HTTP server answering every GET with ``body`` (and a made-up MAC)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header(MAC_HEADER, "0" * 64)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _payload_bytes(marker: Path) -> bytes:
    """A heal state in torchft's own wire format (what its ``HTTPTransport`` unpickles), holding the payload."""
    from torch.distributed._serialization import _streaming_save

    buf = io.BytesIO()
    _streaming_save({"user": {"model": _Payload(marker)}, "torchft": {"step": 10**6, "batches_committed": 0}}, buf)
    return buf.getvalue()


@pytest.fixture
def served() -> Any:
    """A replica's heal server serving a state at step 7, as its quorum thread does for a peer behind it."""
    t = SignedHTTPTransport(new_key(), "127.0.0.1", TIMEOUT)
    t.send_checkpoint([1], 7, {"user": {"model": {"w": torch.ones(3)}}}, TIMEOUT)
    try:
        yield t
    finally:
        t.shutdown()


def _sign(key: bytes, netloc: str, step: int, nonce: str) -> str:
    return hmac.new(key, f"GET|{netloc}|{step}|{nonce}".encode(), hashlib.sha256).hexdigest()


def test_a_heal_server_gives_a_replicas_state_to_no_one_without_the_runs_key(served: SignedHTTPTransport) -> None:
    url = f"{served.metadata()}7"
    nonce = uuid.uuid4().hex
    other_key = bytes.fromhex(new_key())
    for headers in ({}, {NONCE_HEADER: nonce, SIGNATURE_HEADER: _sign(other_key, served.server_address, 7, nonce)}):
        r = httpx.get(url, headers=headers, timeout=5)
        assert r.status_code == 403 and b"torch" not in r.content
    # Signed for another server (what a false recovery source is sent, and could pass on): refused here.
    r = httpx.get(url, headers={NONCE_HEADER: nonce, SIGNATURE_HEADER: _sign(served.key, "10.9.9.9:1", 7, nonce)},
                  timeout=5)
    assert r.status_code == 403
    # The run's own replica gets it, once per nonce: the same request again (a replay) is refused.
    good = {NONCE_HEADER: nonce, SIGNATURE_HEADER: _sign(served.key, served.server_address, 7, nonce)}
    assert httpx.get(url, headers=good, timeout=5).status_code == 200
    assert httpx.get(url, headers=good, timeout=5).status_code == 403
    assert served.refused == 4


def test_a_replica_of_the_run_heals_through_the_signed_transport(served: SignedHTTPTransport) -> None:
    peer = SignedHTTPTransport(served.key.hex(), "127.0.0.1", TIMEOUT)
    try:
        state = peer.recv_checkpoint(0, served.metadata(), 7, TIMEOUT)
        assert torch.equal(state["user"]["model"]["w"], torch.ones(3))
        with pytest.raises(HealRefused, match="HTTP 409"):  # a step older than the one served: at once
            peer.recv_checkpoint(0, served.metadata(), 6, TIMEOUT)
    finally:
        peer.shutdown()
    stranger = SignedHTTPTransport(new_key(), "127.0.0.1", TIMEOUT)  # another run's key
    try:
        with pytest.raises(HealRefused, match="HTTP 403"):
            stranger.recv_checkpoint(0, served.metadata(), 7, TIMEOUT)
    finally:
        stranger.shutdown()


def test_a_false_recovery_sources_state_is_never_unpickled(tmp_path: Path) -> None:
    """The transport of a replica exactly as a live job builds it, handed a false source's address."""
    marker = tmp_path / "code-ran"
    evil = _evil_server(_payload_bytes(marker))
    server = start_lighthouse(1, bind="127.0.0.1:0")
    live = LiveReplica(rank=0, world_size=2, min_replicas=1, lighthouse=server.address(), host="127.0.0.1",
                       heal_key=new_key())
    try:
        with pytest.raises(HealRefused, match="not signed with the run's heal key"):
            live.manager._checkpoint_transport.recv_checkpoint(
                1, f"http://127.0.0.1:{evil.server_address[1]}/checkpoint/", 10**6, TIMEOUT)
        assert not marker.exists(), "the false source's pickle ran in the replica"
    finally:
        live.close()
        server.shutdown()
        evil.shutdown()


class _EvilTransport:
    """A torchft checkpoint transport whose metadata points at the attacker's server."""

    def __init__(self, url: str) -> None:
        self.url = url

    def metadata(self) -> str:
        return self.url

    def send_checkpoint(self, *args: Any) -> None:
        pass

    def disallow_checkpoint(self) -> None:
        pass

    def recv_checkpoint(self, *args: Any) -> Any:
        raise RuntimeError("the attacker heals from no one")

    def shutdown(self, wait: bool = True) -> None:
        pass


def _attacker(lighthouse: str, replica_id: str, url: str) -> Any:
    """A real torchft Manager joined to the job's lighthouse, one million steps ahead of the job."""
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Manager(pg=ProcessGroupGloo(timeout=TIMEOUT), load_state_dict=lambda s: None, state_dict=dict,
                min_replica_size=1, use_async_quorum=False, timeout=TIMEOUT, quorum_timeout=timedelta(seconds=30),
                rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                replica_id=replica_id, hostname="127.0.0.1", init_sync=True, checkpoint_transport=_EvilTransport(url))
    m._step = 10**6
    m._store_keepalive = store
    return m


def _quorum_with_attacker(replica_id: str, marker: Path) -> tuple[LiveReplica, BaseException | None]:
    """A replica of a 2-rank job and the attacker ask the lighthouse for a quorum together."""
    torch.set_num_threads(1)
    evil = _evil_server(_payload_bytes(marker))
    server = start_lighthouse(2, bind="127.0.0.1:0", join_timeout_ms=20_000)
    live = LiveReplica(rank=0, world_size=2, min_replicas=1, lighthouse=server.address(), host="127.0.0.1",
                       heal_key=new_key(), collective_timeout_s=5.0)
    live.register({"model": torch.nn.Linear(2, 2)})
    attacker = _attacker(server.address(), replica_id, f"http://127.0.0.1:{evil.server_address[1]}/checkpoint/")
    errors: list[BaseException] = []

    def join() -> None:
        try:
            attacker.start_quorum()
        except BaseException as e:  # noqa: BLE001 - the attacker's fate is not asserted
            errors.append(e)

    t = threading.Thread(target=join, daemon=True)
    t.start()
    outcome: BaseException | None = None
    try:
        live.manager.start_quorum()
    except BaseException as e:  # noqa: BLE001 - returned to the test
        outcome = e
    t.join(30)
    attacker.shutdown(wait=False)
    server.shutdown()
    evil.shutdown()
    return live, outcome


def test_a_member_with_a_foreign_id_makes_its_quorum_refused(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    live, outcome = _quorum_with_attacker("intruder", marker)
    try:
        assert isinstance(outcome, ForeignQuorum), repr(outcome)
        assert live.guard.refused == 1
        assert not marker.exists()
        assert live.manager.current_step() == 0  # not taken to the intruder's step
    finally:
        live.close()


def test_a_member_posing_as_a_rank_ahead_of_the_job_heals_no_one(tmp_path: Path) -> None:
    """Named as a rank of the job would be: it passes the membership check, becomes the quorum's recovery
    source, and the replica's heal from it is refused before anything of it is loaded."""
    marker = tmp_path / "code-ran"
    live, outcome = _quorum_with_attacker("rank_1", marker)
    try:
        assert outcome is None, repr(outcome)
        err = live.manager.errored()
        assert err is not None and isinstance(err.original_exception, HealRefused), repr(err)
        assert not marker.exists(), "the attacker's pickle ran in the replica"
        assert live.guard.refused == 0
    finally:
        live.close()


def test_the_membership_rule() -> None:
    u = str(uuid.uuid4())
    assert foreign_members([f"rank_0:{u}", f"rank_1:{u}"], 2) == []
    assert foreign_members([f"rank_2:{u}", "rank_0", f"evil:{u}", f"rank_0:{u}x", f"bench_1:{u}"], 2) == [
        f"rank_2:{u}", "rank_0", f"evil:{u}", f"rank_0:{u}x", f"bench_1:{u}"]
    assert foreign_members([f"bench_1:{u}"], 2, prefix="bench_") == []
