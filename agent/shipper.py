"""Ships rank samples and heartbeats to the controller in numbered, gzip-compressed batches.

A batch closes when it holds ``max_batch_items`` samples or ``flush_interval_s`` has passed, and
a heartbeat rides on a batch every ``heartbeat_interval_s`` (an otherwise empty batch is fine).
Each batch gets the next sequence number from the spool (persisted, never reused) and is posted
once. If the controller cannot take it (connection error, timeout, 5xx, ...) the batch goes to
the disk spool and the shipper backs off exponentially; while anything is spooled, new batches
queue behind it on disk, and the spool is replayed oldest first, so the controller receives
batches in order. Replays are safe: ingest is idempotent on (agent_id, seq).

With several controllers (``AgentConfig.controller_urls``), a post that finds its controller down
(connection error, timeout, 5xx) is made again at once, the same bytes, on the next one
(:mod:`agent.failover`); only when none takes it does the batch go to the spool. The same
``(agent_id, seq)`` reaching two controllers is a replay to the second: exactly once still holds.

Batches travel in the columnar wire format (:mod:`agent.columnar`, ``POST /telemetry/columnar``:
a fraction of the controller's CPU per sample) when the transport can post it; a controller that
answers 404 there (older than the endpoint) gets JSON instead, the same batch number and samples,
and is asked again for columns after ``columnar_retry_s``. Spooled files record their format.

An answer of 400/413/422 means the batch itself is bad: it is logged, counted and dropped, never
retried. Every other failure (connection refused, timeout, 5xx, but also 401/403 for a wrong
token or 404 for an older controller) is retried: the data waits in the bounded spool until the
controller or the configuration is fixed. Samples lost on this node (buffer overflow, spool full, rejected batches) are counted
and reported in every heartbeat as ``dropped_samples``.

``step()`` runs one iteration; the clock, the randomness of the jitter and the HTTP transport
are parameters, so tests drive the state machine without sleeping or a server.
"""

from __future__ import annotations

import enum
import gzip
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx
from pydantic import ValidationError

from agent import columnar
from agent.failover import FailoverClient
from agent.receiver import Sample, SampleBuffer
from agent.spool import Spool
from vigil.contract.client import ApiError, VigilClient
from vigil.contract.schemas import MAX_TELEMETRY_ITEMS, Heartbeat, TelemetryAck, TelemetryBatch

log = logging.getLogger(__name__)

#: Answers that condemn the batch itself; retrying would only repeat them.
REJECT_STATUSES = frozenset({400, 413, 422})


class Transport(Protocol):
    """Posts one gzip-compressed TelemetryBatch body; raises on failure. A transport that also has
    ``post_columnar(body) -> TelemetryAck`` (gzip columnar body, :class:`ClientTransport`) gets columns."""

    def post(self, body: bytes) -> TelemetryAck: ...


class ClientTransport:
    """The real transport: :meth:`VigilClient.post_telemetry_raw` with gzip encoding, on the controller
    that answers (a :class:`~agent.failover.FailoverClient`; a single client is one controller)."""

    def __init__(self, client: VigilClient | FailoverClient) -> None:
        self.client = client if isinstance(client, FailoverClient) else FailoverClient([client], [""])

    def post(self, body: bytes) -> TelemetryAck:
        return self.client.call(lambda c: c.post_telemetry_raw(body, encoding="gzip"))

    def post_columnar(self, body: bytes) -> TelemetryAck:
        return self.client.call(lambda c: c.post_telemetry_columnar(body, encoding="gzip"))


class Outcome(enum.Enum):
    SENT = "sent"  # stored by the controller (or recognised as a replay)
    REJECTED = "rejected"  # the batch is bad; dropped
    RETRY = "retry"  # the controller could not take it now


@dataclass
class ShipperConfig:
    """How batches are cut, numbered and retried."""

    agent_id: str
    node_id: str
    #: Most samples per batch (never above the controller's MAX_TELEMETRY_ITEMS).
    max_batch_items: int = 2000
    #: Longest a sample waits in memory before its batch is sent or spooled.
    flush_interval_s: float = 0.5
    #: Period of heartbeats; 0 disables them.
    heartbeat_interval_s: float = 1.0
    #: Largest uncompressed batch; a bigger one is split (keeps bodies under the API's limit).
    max_batch_bytes: int = 6 << 20
    #: First wait after a failed post; doubled on each further failure up to ``backoff_max_s``.
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    #: Each wait is shortened by up to this fraction at random, so agents do not retry in step.
    backoff_jitter: float = 0.2
    #: Longest one step spends replaying the spool before it cuts new batches again.
    drain_budget_s: float = 1.0
    gzip_level: int = 5
    #: ``columnar`` (the default, when the transport can post it) or ``json``.
    wire_format: str = "columnar"
    #: After a controller answered 404 to a columnar post, JSON for this long, then columns again.
    columnar_retry_s: float = 300.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_items <= MAX_TELEMETRY_ITEMS:
            raise ValueError(
                f"max_batch_items must be in [1, {MAX_TELEMETRY_ITEMS}], got {self.max_batch_items}"
            )
        if self.flush_interval_s <= 0:
            raise ValueError(f"flush_interval_s must be > 0, got {self.flush_interval_s}")
        if self.heartbeat_interval_s < 0:
            raise ValueError(f"heartbeat_interval_s must be >= 0, got {self.heartbeat_interval_s}")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("backoff must satisfy 0 < backoff_initial_s <= backoff_max_s")
        if not 0 <= self.backoff_jitter < 1:
            raise ValueError(f"backoff_jitter must be in [0, 1), got {self.backoff_jitter}")
        if self.wire_format not in ("columnar", "json"):
            raise ValueError(f"wire_format must be columnar or json, got {self.wire_format!r}")


@dataclass
class ShipperStats:
    batches_built: int = 0
    sent_batches: int = 0
    sent_samples: int = 0
    duplicate_batches: int = 0
    rejected_batches: int = 0
    rejected_samples: int = 0
    failed_posts: int = 0
    spooled_batches: int = 0
    lost_samples: int = 0  # spool write failed (disk full, ...)
    heartbeats: int = 0
    json_fallbacks: int = 0  # columnar batches sent as JSON to a controller without the endpoint


#: Builds the heartbeat: (unix time, samples dropped on this node so far) -> Heartbeat.
HeartbeatFn = Callable[[float, int], Heartbeat]


class Shipper:
    """The batching / posting / spooling state machine. Single-threaded: call ``step()``."""

    def __init__(
        self,
        config: ShipperConfig,
        buffer: SampleBuffer,
        spool: Spool,
        transport: Transport,
        heartbeat: HeartbeatFn | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.buffer = buffer
        self.spool = spool
        self.transport = transport
        self.stats = ShipperStats()
        self._heartbeat = heartbeat
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng or random.Random()
        now = clock()
        self._next_flush = now + config.flush_interval_s
        self._next_heartbeat = now  # the first step says hello at once
        self._failures = 0
        self._retry_at = float("-inf")
        self._outage_since: float | None = None
        self._columnar_after = float("-inf")  # columns are refused (404) until then

    # -- counters -----------------------------------------------------------------------------------
    @property
    def dropped_samples(self) -> int:
        """Samples lost on this node since the agent started (what the heartbeat reports)."""
        return (
            self.buffer.overflow
            + self.spool.dropped_samples
            + self.stats.rejected_samples
            + self.stats.lost_samples
        )

    @property
    def backing_off(self) -> bool:
        return self._clock() < self._retry_at

    # -- the loop body ----------------------------------------------------------------------------
    def step(self) -> float:
        """Cut the batches that are due, send or spool them, replay the spool.

        Returns the seconds until something is next due (the caller may sleep that long unless
        woken by a full buffer).
        """
        now = self._clock()
        # Full batches first, bounded per step so a flood cannot starve the replay.
        for _ in range(16):
            if len(self.buffer) < self.config.max_batch_items:
                break
            self._cut(now)
        heartbeat_due = (
            self._heartbeat is not None
            and self.config.heartbeat_interval_s > 0
            and (now >= self._next_heartbeat)
        )
        if heartbeat_due or (now >= self._next_flush and len(self.buffer) > 0):
            self._cut(now)
        if now >= self._next_flush:
            self._next_flush = now + self.config.flush_interval_s
        self._drain(deadline=now + self.config.drain_budget_s)
        return self._until_next()

    def flush(self, drain_budget_s: float = 2.0) -> None:
        """Final flush on shutdown: cut every buffered sample into batches (the last heartbeat
        rides along), try each once, and leave what could not be sent in the spool."""
        now = self._clock()
        self._retry_at = float("-inf")  # one last try, whatever the backoff said
        self._cut(now, force_heartbeat=True)
        while len(self.buffer) > 0:
            self._cut(now)
        self._drain(deadline=self._clock() + drain_budget_s)
        if len(self.spool):
            log.info(
                "%d batches (%d samples) left in the spool for the next run",
                len(self.spool),
                self.spool.samples,
            )

    def _until_next(self) -> float:
        now = self._clock()
        due = [self._next_flush]
        if self._heartbeat is not None and self.config.heartbeat_interval_s > 0:
            due.append(self._next_heartbeat)
        if len(self.spool):
            due.append(self._retry_at)
        if len(self.buffer) >= self.config.max_batch_items:
            return 0.0
        return max(0.0, min(due) - now)

    # -- building batches ---------------------------------------------------------------------------
    def _cut(self, now: float, force_heartbeat: bool = False) -> None:
        """Take up to one batch of samples (plus the heartbeat if due), number it, dispatch it."""
        samples = self.buffer.take(self.config.max_batch_items)
        heartbeat = None
        if self._heartbeat is not None and (
            force_heartbeat or (self.config.heartbeat_interval_s > 0 and now >= self._next_heartbeat)
        ):
            heartbeat = self._make_heartbeat()
            self._next_heartbeat = now + self.config.heartbeat_interval_s
        if not samples and heartbeat is None:
            return
        fmt = self._format()
        while True:
            chunk, seq, raw = self._encode(samples, heartbeat, fmt)
            self.stats.batches_built += 1
            if heartbeat is not None:
                self.stats.heartbeats += 1
            self._dispatch(seq, gzip.compress(raw, compresslevel=self.config.gzip_level), len(chunk), fmt)
            samples, heartbeat = samples[len(chunk) :], None
            if not samples:
                return

    def _format(self) -> str:
        """The wire format of the next batch: columns when configured, postable, and not refused lately."""
        if (self.config.wire_format == "columnar" and hasattr(self.transport, "post_columnar")
                and self._clock() >= self._columnar_after):
            return "columnar"
        return "json"

    def _encode(self, samples: list[Sample], heartbeat: Heartbeat | None, fmt: str = "json"
                ) -> tuple[list[Sample], int, bytes]:
        """Number and serialise the longest prefix of ``samples`` that fits ``max_batch_bytes``.

        Halves the prefix until it fits; each number taken for a batch that turned out too big is
        skipped (gaps are harmless, reuse is not).
        """
        chunk = samples
        while True:
            seq = self.spool.allocate_seq()
            if fmt == "columnar":
                raw = columnar.encode(self.config.agent_id, self.config.node_id, seq, self._wall_clock(), chunk,
                                      heartbeat)
                if len(raw) <= self.config.max_batch_bytes or len(chunk) <= 1:
                    return chunk, seq, raw
                chunk = chunk[: len(chunk) // 2]
                continue
            batch = TelemetryBatch(
                agent_id=self.config.agent_id,
                node_id=self.config.node_id,
                seq=seq,
                sent_at=self._wall_clock(),
                samples=chunk,
                heartbeat=heartbeat,
            )
            raw = batch.model_dump_json().encode()
            if len(raw) <= self.config.max_batch_bytes or len(chunk) <= 1:
                return chunk, seq, raw
            chunk = chunk[: len(chunk) // 2]

    def _make_heartbeat(self) -> Heartbeat | None:
        assert self._heartbeat is not None
        try:
            return self._heartbeat(self._wall_clock(), self.dropped_samples)
        except Exception:
            log.exception("building the heartbeat failed")
            return None

    def _dispatch(self, seq: int, body: bytes, n_samples: int, fmt: str = "json") -> None:
        # Straight to the controller only when nothing waits before this batch and we are not
        # backing off; otherwise behind the spooled ones, so order is kept.
        if len(self.spool) == 0 and self._clock() >= self._retry_at:
            outcome = self._post(seq, body, n_samples, fmt)
            if outcome is not Outcome.RETRY:
                return
        self._to_spool(seq, body, n_samples, fmt)

    def _to_spool(self, seq: int, body: bytes, n_samples: int, fmt: str = "json") -> None:
        try:
            lost = self.spool.put(seq, body, n_samples, fmt)
        except OSError as exc:
            self.stats.lost_samples += n_samples
            log.error("cannot spool batch %d (%d samples lost): %s", seq, n_samples, exc)
            return
        self.stats.spooled_batches += 1
        if lost:
            log.warning(
                "spool full (%d bytes): %d samples lost so far",
                self.spool.max_bytes,
                self.spool.dropped_samples,
            )

    # -- sending ------------------------------------------------------------------------------------
    def _drain(self, deadline: float) -> None:
        """Replay spooled batches oldest first until empty, a failure, or the deadline."""
        while len(self.spool) and self._clock() >= self._retry_at and self._clock() < deadline:
            b = self.spool.oldest()
            assert b is not None
            try:
                body = b.read()
            except OSError as exc:
                log.error("cannot read spooled batch %d (%d samples lost): %s", b.seq, b.samples, exc)
                self.stats.lost_samples += b.samples
                self.spool.remove(b.seq)
                continue
            outcome = self._post(b.seq, body, b.samples, b.format)
            if outcome is Outcome.RETRY:
                return
            self.spool.remove(b.seq)

    def _send(self, body: bytes, fmt: str) -> TelemetryAck:
        """Post ``body`` in its format; a columnar one goes as JSON where columns are not (yet) taken."""
        post_columnar = getattr(self.transport, "post_columnar", None)
        if fmt == "columnar" and post_columnar is not None and self._clock() >= self._columnar_after:
            try:
                return post_columnar(body)
            except ApiError as exc:
                if exc.status_code != 404:
                    raise
                log.warning("the controller has no columnar ingest (HTTP 404): sending JSON for %.0fs",
                            self.config.columnar_retry_s)
                self._columnar_after = self._clock() + self.config.columnar_retry_s
        if fmt == "columnar":  # the same batch (number, samples, heartbeat) re-encoded as JSON
            self.stats.json_fallbacks += 1
            batch = columnar.to_batch(gzip.decompress(body))
            body = gzip.compress(batch.model_dump_json().encode(), compresslevel=self.config.gzip_level)
        return self.transport.post(body)

    def _post(self, seq: int, body: bytes, n_samples: int, fmt: str = "json") -> Outcome:
        try:
            ack = self._send(body, fmt)
        except ApiError as exc:
            if exc.status_code in REJECT_STATUSES:
                self.stats.rejected_batches += 1
                self.stats.rejected_samples += n_samples
                log.error(
                    "controller rejected batch %d (%d samples) with HTTP %d, dropping it: %s",
                    seq,
                    n_samples,
                    exc.status_code,
                    exc.detail,
                )
                return Outcome.REJECTED
            return self._failed(seq, f"HTTP {exc.status_code}: {exc.detail}")
        except (httpx.HTTPError, ValidationError, OSError) as exc:
            return self._failed(seq, f"{type(exc).__name__}: {exc}")
        self._succeeded()
        self.stats.sent_batches += 1
        self.stats.sent_samples += n_samples
        if ack.duplicate:
            self.stats.duplicate_batches += 1
        return Outcome.SENT

    def _failed(self, seq: int, why: str) -> Outcome:
        self.stats.failed_posts += 1
        self._failures += 1
        base = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (self._failures - 1))
        delay = base * (1.0 - self.config.backoff_jitter * self._rng.random())
        now = self._clock()
        self._retry_at = now + delay
        if self._outage_since is None:
            self._outage_since = now
            log.warning("controller unreachable (batch %d: %s); spooling, retrying with backoff", seq, why)
        else:
            log.debug("post of batch %d failed again (%s); next try in %.2fs", seq, why, delay)
        return Outcome.RETRY

    def _succeeded(self) -> None:
        if self._outage_since is not None:
            log.info(
                "controller reachable again after %.1fs; replaying %d spooled batches",
                self._clock() - self._outage_since,
                len(self.spool),
            )
            self._outage_since = None
        self._failures = 0
        self._retry_at = float("-inf")

    @property
    def retry_delay_s(self) -> float:
        """Seconds until the next retry (0 when not backing off)."""
        return max(0.0, self._retry_at - self._clock())
