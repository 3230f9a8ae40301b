"""What a live job's replicas trust of each other: heals signed with the run's key, quorums of the job's ranks.

torchft 0.2.0's own (``HTTPTransport``) serves a replica's whole state (weights, optimizer) to anyone who
asks for it, and the healing side unpickles (``weights_only=False``) whatever the quorum's recovery source
sends. The lighthouse takes no credential: a process that joins it with a higher step than the job's
becomes the recovery source of every replica behind it, and its pickle runs its code in them.

This one keeps torchft's shape (:meth:`metadata` is the URL a healing peer fetches from; the state is
served from :meth:`send_checkpoint` until :meth:`disallow_checkpoint`) and adds a key that only the run's
replicas hold (the driver draws it for each run, :func:`new_key`, and hands it to its replica actors):

* a request names a fresh nonce and carries ``HMAC(key, GET | server address | step | nonce)``: the
  server answers 403 to any other, to one signed for another server's address (what a false recovery
  source would be handed), and to a nonce it has seen (a replay);
* the answer carries ``HMAC(key, nonce | step | sha256(body))``: the healing side checks it before it
  unpickles a byte, so a state from anything but one of the run's own replicas is refused.

:class:`QuorumGuard` refuses a quorum with a member that cannot be one of the job's replicas (an id that is
not ``rank_<r>:<uuid>`` for a rank ``r`` of the job): a stray or naive process that joined the lighthouse is
never trained with nor healed from. A member that copies a real replica's id (every member sees them all)
passes it; its heal is refused by the key above.

What neither covers (torchft's lighthouse, manager server and the replicas' TCP store take no
credential; gloo's connections are not authenticated): docs/SECURITY.md.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import logging
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.utils._pytree import tree_map
from torchft.checkpointing.transport import CheckpointTransport

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_HEADER = "X-Vigil-Nonce"
SIGNATURE_HEADER = "X-Vigil-Signature"
MAC_HEADER = "X-Vigil-Mac"
SEEN_NONCES = 4096
"""Nonces a server remembers (a replay of an older one is refused by its step: a step is served once)."""


class HealRefused(RuntimeError):
    """A heal's answer that is not from one of the run's replicas (or an error answer)."""


def new_key() -> str:
    """A run's heal key (hex): the driver draws one per run."""
    return secrets.token_hex(KEY_BYTES)


def _mac(key: bytes, *parts: object) -> str:
    return hmac.new(key, "|".join(str(p) for p in parts).encode(), hashlib.sha256).hexdigest()


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Handler(BaseHTTPRequestHandler):
    """``GET /checkpoint/<step>``, signed (module docstring)."""

    def __init__(self, transport: SignedHTTPTransport, *args: Any) -> None:
        self.transport = transport
        self.timeout = transport.timeout_s  # the request socket's: a client that stalls is dropped
        super().__init__(*args)

    def do_GET(self) -> None:
        t = self.transport
        parts = self.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] != "checkpoint" or not parts[1].isdigit():
            self.send_error(404, "expected /checkpoint/<step>")
            return
        step = int(parts[1])
        nonce = self.headers.get(NONCE_HEADER, "")
        signature = self.headers.get(SIGNATURE_HEADER, "")
        if not t.admit(step, nonce, signature):
            self.send_error(403, "not signed with this run's heal key")
            return
        served = t.wait_for(step)
        if served is None:
            self.send_error(409, f"step {step} is not served here")
            return
        body, digest = served
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header(MAC_HEADER, _mac(t.key, nonce, step, digest))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("heal server: " + format, *args)


class SignedHTTPTransport(CheckpointTransport[Any]):
    """torchft's checkpoint transport for heals, every request and answer signed with the run's key."""

    def __init__(self, key: str, host: str, timeout: timedelta) -> None:
        raw = bytes.fromhex(key)
        if len(raw) < 16:
            raise ValueError(f"heal key must be at least 16 bytes, got {len(raw)}")
        self.key = raw
        self.timeout_s = timeout.total_seconds()
        self.refused = 0
        """Requests refused for their signature or nonce (counted; each logged)."""
        self._cond = threading.Condition()
        self._served: tuple[int, bytes, str] | None = None
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) if ":" in host else _Server
        self._server = server_cls((host, 0), partial(_Handler, self))
        self.server_address = _hostport(host, self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="vigil-heal-server", daemon=True)
        self._thread.start()

    # -- the serving side --------------------------------------------------------------------------

    def admit(self, step: int, nonce: str, signature: str) -> bool:
        """Whether a request for ``step`` is signed for this server with the run's key, with a new nonce."""
        ok = 16 <= len(nonce) <= 128 and hmac.compare_digest(
            _mac(self.key, "GET", self.server_address, step, nonce), signature)
        with self._cond:
            if ok and nonce in self._seen:
                ok = False
            if ok:
                self._seen[nonce] = None
                while len(self._seen) > SEEN_NONCES:
                    self._seen.popitem(last=False)
            else:
                self.refused += 1
        if not ok:
            log.warning("heal server %s: refused a request for step %d (not signed with the run's key, or "
                        "replayed)", self.server_address, step)
        return ok

    def wait_for(self, step: int) -> tuple[bytes, str] | None:
        """The state of ``step`` once :meth:`send_checkpoint` serves it (a peer may ask first), else None."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._served is None or self._served[0] < step:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            served_step, body, digest = self._served
        return (body, digest) if served_step == step else None

    def metadata(self) -> str:
        return f"http://{self.server_address}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buf = io.BytesIO()
        torch.save(tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state_dict), buf)
        body = buf.getvalue()
        with self._cond:
            self._served = (step, body, hashlib.sha256(body).hexdigest())
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._served = None

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=self.timeout_s)

    # -- the healing side --------------------------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        parts = urlsplit(metadata)
        netloc = parts.netloc
        if parts.scheme != "http" or not netloc:
            raise HealRefused(f"heal source {src_rank}: no address in {metadata!r}")
        nonce = secrets.token_hex(16)
        headers = {NONCE_HEADER: nonce, SIGNATURE_HEADER: _mac(self.key, "GET", netloc, step, nonce)}
        request = urllib.request.Request(f"{metadata}{step}", headers=headers)
        try:
            # urllib reads a Content-Length body in one go (httpx's 64 KiB chunks took longer than the hashing).
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as r:
                body, mac = r.read(), r.headers.get(MAC_HEADER, "")
        except urllib.error.HTTPError as e:
            raise HealRefused(f"heal source {src_rank} at {netloc}: HTTP {e.code} for step {step}") from None
        want = _mac(self.key, nonce, step, hashlib.sha256(body).hexdigest())
        if not hmac.compare_digest(want, mac):
            raise HealRefused(f"heal source {src_rank} at {netloc}: its state for step {step} is not signed with "
                              "the run's heal key (not one of this job's replicas); nothing of it was loaded")
        # Signed by a holder of the run's key (one of this job's own replicas): its objects are the job's own.
        return torch.load(io.BytesIO(body), weights_only=False)


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
"""What torchft's Manager adds to a replica's id (``<prefix><rank>:<uuid>``)."""


class ForeignQuorum(RuntimeError):
    """A quorum with a member that is not one of the job's replicas."""


def foreign_members(replica_ids: list[str], world_size: int, prefix: str = "rank_") -> list[str]:
    """The ids in a quorum that cannot be the job's replicas (not ``<prefix><r>:<uuid>`` with ``r < world_size``)."""
    pattern = re.compile(re.escape(prefix) + r"(\d{1,9}):" + UUID)
    bad = []
    for rid in replica_ids:
        m = pattern.fullmatch(rid)
        if m is None or int(m[1]) >= world_size:
            bad.append(rid)
    return bad


class QuorumGuard:
    """torchft's manager client, whose quorum answers are checked against the job's ranks (module docstring).

    Installed in place of ``Manager._client``; everything but ``_quorum`` passes through unchanged.
    """

    def __init__(self, client: Any, world_size: int, prefix: str = "rank_") -> None:
        self._inner = client
        self.world_size = world_size
        self.prefix = prefix
        self.refused = 0

    def _quorum(self, **kwargs: Any) -> Any:
        quorum = self._inner._quorum(**kwargs)
        bad = foreign_members(list(quorum.replica_ids), self.world_size, self.prefix)
        if bad:
            self.refused += 1
            log.error("quorum %s refused: members %s are not replicas of this job (ranks 0-%d); nothing is "
                      "trained with or healed from them", quorum.quorum_id, bad[:4], self.world_size - 1)
            raise ForeignQuorum(f"quorum {quorum.quorum_id} has members that are not this job's replicas: {bad[:4]}")
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
