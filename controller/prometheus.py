"""Prometheus export: ``/metrics`` in the text format, read from the database on each scrape.

A custom collector, not gauges updated on ingest, because:

* the state lives in the database (aggregates, nodes' latest heartbeats), so a restarted
  controller, or a second one on the same database, exports the same values at once;
* ingest is the hot path (100k samples/s): it should not also pay for updating gauges, while a
  scrape every 15 s costs a handful of indexed queries;
* label sets stay bounded by construction, and series of a job that ended simply stop being
  exported instead of lingering until someone removes their labels.

Bounded labels: only active jobs (PENDING/RUNNING), at most ``max_jobs`` (newest first); per job,
per-rank series only for the ``max_ranks`` slowest ranks of the latest aggregated step (job-level
series summarise all ranks); at most ``MAX_KINDS`` kinds of collective per job and
``MAX_INTERFACES`` NICs per node; label values are cut to ``LABEL_MAX`` characters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Row, func, select
from sqlalchemy.orm import Session, sessionmaker

from controller.db import session_scope
from controller.models import CollectiveStepStat, Job, JobStepStat, Node, RankStepStat
from controller.seconds_lost import rank_totals
from controller.step_read import newest_final
from controller.telemetry_guard import REFUSED
from vigil.contract.schemas import JobStatus

MAX_KINDS = 16
MAX_INTERFACES = 16
MAX_NODES = 4096
LABEL_MAX = 64
#: Upper bounds (seconds) of the histograms of step and collective time across ranks.
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
NIC_RATES = {
    "rx_bytes_per_s": ("vigil_node_nic_receive_bytes_per_second", "Bytes received per second (from counters)."),
    "tx_bytes_per_s": ("vigil_node_nic_transmit_bytes_per_second", "Bytes sent per second (from counters)."),
    "rx_errors_per_s": ("vigil_node_nic_receive_errors_per_second", "Receive errors per second."),
    "tx_errors_per_s": ("vigil_node_nic_transmit_errors_per_second", "Transmit errors per second."),
    "rx_dropped_per_s": ("vigil_node_nic_receive_drops_per_second", "Received packets dropped per second."),
    "tx_dropped_per_s": ("vigil_node_nic_transmit_drops_per_second", "Sent packets dropped per second."),
}


#: Buckets (seconds) of the monitor's pass time: its goal is well under a second even while ingest floods.
PASS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Process metrics, observed where the work happens (not read from the database): registered in no
# registry of their own, every app's registry exports them through :class:`ProcessCollector`.
MONITOR_PASS_SECONDS = Histogram("vigil_monitor_pass_seconds", "Duration of one monitor pass (detectors, "
                                 "policy, actions), in this process.", buckets=PASS_BUCKETS, registry=None)
MONITOR_LAST_PASS_SECONDS = Gauge("vigil_monitor_last_pass_seconds", "Duration of the latest monitor pass in this "
                                  "process (0: none yet; only the leader runs the monitor).", registry=None)


class ProcessCollector(Collector):
    """This process's own metrics (the monitor's pass time), next to the database's."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from MONITOR_PASS_SECONDS.collect()
        yield from MONITOR_LAST_PASS_SECONDS.collect()
        yield from REFUSED.collect()


def _label(v: object) -> str:
    return str(v)[:LABEL_MAX]


def _histogram(name: str, doc: str, labels: list[str], values_by_labels: dict[tuple[str, ...], list[float]]
               ) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=labels)
    for key, values in values_by_labels.items():
        buckets = [(str(b), float(sum(1 for v in values if v <= b))) for b in TIME_BUCKETS]
        buckets.append(("+Inf", float(len(values))))
        h.add_metric(list(key), buckets, sum_value=sum(values))
    return h


def _job_counts(session: Session) -> GaugeMetricFamily:
    """``vigil_jobs``: every job status, with its count (0 included)."""
    counts = GaugeMetricFamily("vigil_jobs", "Jobs by status.", labels=["status"])
    by_status = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
    for st in JobStatus:
        counts.add_metric([st.value], float(by_status.get(st.value, 0)))
    return counts


def _rank_values(session: Session, job_id: str, step: int, column: Any) -> list[float]:
    """``column`` of ``rank_step_stats`` over every rank of (job, step) that has it."""
    values = session.scalars(
        select(column).where(RankStepStat.job_id == job_id, RankStepStat.step == step, column.is_not(None))
    ).all()
    return [float(v) for v in values if v is not None]


def _slowest_ranks(session: Session, job_id: str, step: int, limit: int) -> Sequence[Row[Any]]:
    """The ``limit`` slowest ranks of (job, step): rank, node, step time, comm, wait, wire bytes."""
    return session.execute(
        select(RankStepStat.rank, RankStepStat.node_id, RankStepStat.step_time_s, RankStepStat.comm_s,
               RankStepStat.comm_wait_s, RankStepStat.wire_bytes)
        .where(RankStepStat.job_id == job_id, RankStepStat.step == step)
        .order_by(RankStepStat.step_time_s.desc(), RankStepStat.rank).limit(limit)
    ).all()


def _top_kinds(session: Session, job_id: str, step: int) -> Sequence[CollectiveStepStat]:
    """The :data:`MAX_KINDS` kinds of collective of (job, step) with the largest max time."""
    return session.scalars(
        select(CollectiveStepStat).where(CollectiveStepStat.job_id == job_id, CollectiveStepStat.step == step)
        .order_by(CollectiveStepStat.max_s.desc()).limit(MAX_KINDS)
    ).all()


@dataclass
class _JobGauges:
    """The gauge families of the active jobs' newest aggregated steps, filled job by job in one scrape."""

    last_step: GaugeMetricFamily
    agg_step: GaugeMetricFamily
    loss: GaugeMetricFamily
    st_p50: GaugeMetricFamily
    st_max: GaugeMetricFamily
    wait_max: GaugeMetricFamily
    bits: GaugeMetricFamily
    ranks: GaugeMetricFamily
    r_time: GaugeMetricFamily
    r_comm: GaugeMetricFamily
    r_wait: GaugeMetricFamily
    r_bits: GaugeMetricFamily
    c_p50: GaugeMetricFamily
    c_max: GaugeMetricFamily
    c_wait: GaugeMetricFamily
    c_bits: GaugeMetricFamily
    lost: GaugeMetricFamily
    r_lost: GaugeMetricFamily

    @classmethod
    def new(cls) -> _JobGauges:
        job, rank, kind = ["job"], ["job", "rank", "node"], ["job", "op", "group", "tag"]
        return cls(
            last_step=GaugeMetricFamily("vigil_job_last_step", "Newest step reported by the job.", labels=job),
            agg_step=GaugeMetricFamily("vigil_job_aggregated_step", "Newest aggregated step.", labels=job),
            loss=GaugeMetricFamily("vigil_job_loss", "Mean training loss over ranks of the newest aggregated step.",
                                   labels=job),
            st_p50=GaugeMetricFamily("vigil_job_step_time_p50_seconds", "Median step time over ranks (newest step).",
                                     labels=job),
            st_max=GaugeMetricFamily("vigil_job_step_time_max_seconds", "Slowest rank's step time (newest step).",
                                     labels=job),
            wait_max=GaugeMetricFamily("vigil_job_comm_wait_max_seconds",
                                       "Largest wait inside collectives of any rank (newest step).", labels=job),
            bits=GaugeMetricFamily("vigil_job_wire_bits_per_step", "Bits all ranks put on the wire in the newest step.",
                                   labels=job),
            ranks=GaugeMetricFamily("vigil_job_ranks", "Ranks that reported the newest aggregated step.", labels=job),
            r_time=GaugeMetricFamily("vigil_rank_step_time_seconds", "Step time of the slowest ranks (newest step).",
                                     labels=rank),
            r_comm=GaugeMetricFamily("vigil_rank_comm_seconds", "Time in collectives (newest step).", labels=rank),
            r_wait=GaugeMetricFamily("vigil_rank_comm_wait_seconds", "Wait inside collectives (newest step).",
                                     labels=rank),
            r_bits=GaugeMetricFamily("vigil_rank_wire_bits", "Bits the rank put on the wire (newest step).",
                                     labels=rank),
            c_p50=GaugeMetricFamily("vigil_collective_p50_seconds",
                                    "Median over ranks of time in this collective kind.", labels=kind),
            c_max=GaugeMetricFamily("vigil_collective_max_seconds", "Slowest rank's time in this collective kind.",
                                    labels=kind),
            c_wait=GaugeMetricFamily("vigil_collective_wait_max_seconds", "Largest wait in this collective kind.",
                                     labels=kind),
            c_bits=GaugeMetricFamily("vigil_collective_wire_bits",
                                     "Bits on the wire, all ranks, this kind, newest step.", labels=kind),
            lost=GaugeMetricFamily("vigil_job_seconds_lost_to_slow_ranks",
                                   "Seconds the job's steps lost waiting for ranks slower than the median rank, so far.",
                                   labels=job),
            r_lost=GaugeMetricFamily("vigil_rank_seconds_lost",
                                     "This rank's share of the seconds lost to slow ranks, so far (the ranks that cost "
                                     "the most).", labels=["job", "rank"]),
        )

    def families(self) -> tuple[GaugeMetricFamily, ...]:
        """Every family, in export order."""
        return (self.last_step, self.agg_step, self.loss, self.st_p50, self.st_max, self.wait_max, self.bits,
                self.ranks, self.r_time, self.r_comm, self.r_wait, self.r_bits, self.c_p50, self.c_max, self.c_wait,
                self.c_bits, self.lost, self.r_lost)

    def add_step(self, jl: str, latest: JobStepStat) -> None:
        """The job-wide figures of the job's newest aggregated step."""
        self.agg_step.add_metric([jl], float(latest.step))
        self.ranks.add_metric([jl], float(latest.ranks))
        self.bits.add_metric([jl], 8.0 * latest.wire_bytes)
        for g, v in ((self.loss, latest.loss_mean), (self.st_p50, latest.step_time_p50_s),
                     (self.st_max, latest.step_time_max_s), (self.wait_max, latest.comm_wait_max_s)):
            if v is not None:
                g.add_metric([jl], float(v))

    def add_ranks(self, jl: str, slow: Iterable[Row[Any]]) -> None:
        """The slowest ranks' series (rows of :func:`_slowest_ranks`)."""
        for r in slow:
            labels = [jl, str(r.rank), _label(r.node_id)]
            for g, v in ((self.r_time, r.step_time_s), (self.r_comm, r.comm_s), (self.r_wait, r.comm_wait_s)):
                if v is not None:
                    g.add_metric(labels, float(v))
            self.r_bits.add_metric(labels, 8.0 * r.wire_bytes)

    def add_lost(self, jl: str, totals: dict[int, tuple[float, int]], limit: int) -> None:
        """Seconds lost to slow ranks: the job's, and the ``limit`` ranks' that cost the most
        (:func:`controller.seconds_lost.rank_totals`)."""
        self.lost.add_metric([jl], sum(lost for lost, _ in totals.values()))
        for rank, (lost, _) in sorted(totals.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]:
            self.r_lost.add_metric([jl, str(rank)], lost)

    def add_kinds(self, jl: str, kinds: Iterable[CollectiveStepStat]) -> None:
        """The collective kinds' series (:func:`_top_kinds`)."""
        for k in kinds:
            labels = [jl, _label(k.op), _label(k.group), _label(k.tag)]
            self.c_p50.add_metric(labels, k.p50_s)
            self.c_max.add_metric(labels, k.max_s)
            self.c_wait.add_metric(labels, k.wait_max_s)
            self.c_bits.add_metric(labels, 8.0 * k.wire_bytes)


class VigilCollector(Collector):
    """Reads the current state on every scrape (see the module docstring for what and why)."""

    def __init__(self, sessions: sessionmaker[Session], *, max_jobs: int = 20, max_ranks: int = 32,
                 clock: Callable[[], float] = time.time) -> None:
        self.sessions = sessions
        self.max_jobs = max_jobs
        self.max_ranks = max_ranks
        self.clock = clock

    def describe(self) -> list[Metric]:
        return []  # no scrape at registration: the database may not be there yet

    def collect(self) -> Iterator[Metric]:
        with session_scope(self.sessions) as session:
            yield from self._jobs(session)
            yield from self._nodes(session)

    # -- jobs -------------------------------------------------------------------------------------
    def _jobs(self, session: Session) -> Iterator[Metric]:
        yield _job_counts(session)
        active = session.scalars(
            select(Job).where(Job.status.in_([JobStatus.PENDING.value, JobStatus.RUNNING.value]))
            .order_by(Job.created_at.desc()).limit(self.max_jobs)
        ).all()
        gauges = _JobGauges.new()
        step_hist: dict[tuple[str, ...], list[float]] = {}
        coll_hist: dict[tuple[str, ...], list[float]] = {}
        for job in active:
            jl = _label(job.id)
            if job.last_step is not None:
                gauges.last_step.add_metric([jl], float(job.last_step))
            latest = newest_final(session, job.id)
            if latest is None:
                continue
            gauges.add_step(jl, latest)
            step_hist[(jl,)] = _rank_values(session, job.id, latest.step, RankStepStat.step_time_s)
            gauges.add_ranks(jl, _slowest_ranks(session, job.id, latest.step, self.max_ranks))
            gauges.add_kinds(jl, _top_kinds(session, job.id, latest.step))
            gauges.add_lost(jl, rank_totals(session, job.id), self.max_ranks)
            coll_hist[(jl,)] = _rank_values(session, job.id, latest.step, RankStepStat.comm_s)
        yield from gauges.families()
        yield _histogram("vigil_job_rank_step_time_seconds", "Step time across the ranks of the newest step.",
                         ["job"], step_hist)
        yield _histogram("vigil_job_rank_comm_seconds", "Time in collectives across the ranks of the newest step.",
                         ["job"], coll_hist)

    # -- nodes ------------------------------------------------------------------------------------
    def _nodes(self, session: Session) -> Iterator[Metric]:
        now = self.clock()
        age = GaugeMetricFamily("vigil_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat.",
                                labels=["node", "state"])
        dropped = GaugeMetricFamily("vigil_node_dropped_samples", "Samples lost on the node since its agent started.",
                                    labels=["node"])
        nic: dict[str, GaugeMetricFamily] = {
            key: GaugeMetricFamily(name, doc, labels=["node", "interface"]) for key, (name, doc) in NIC_RATES.items()
        }
        up = GaugeMetricFamily("vigil_node_nic_up", "1 when the interface's operstate is up.",
                               labels=["node", "interface"])
        for node in session.scalars(select(Node).order_by(Node.id).limit(MAX_NODES)).all():
            nl = _label(node.id)
            if node.last_heartbeat is not None:
                age.add_metric([nl, _label(node.state)], max(0.0, now - node.last_heartbeat.timestamp()))
            dropped.add_metric([nl], float(node.dropped_samples or 0))
            interfaces = _interfaces(node.host)
            for name in sorted(interfaces)[:MAX_INTERFACES]:
                m = interfaces[name]
                il = _label(name)
                for key, g in nic.items():
                    v = m.get(key)
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        g.add_metric([nl, il], float(v))
                if isinstance(m.get("operstate"), str):
                    up.add_metric([nl, il], 1.0 if m["operstate"] == "up" else 0.0)
        yield from (age, dropped, *nic.values(), up)


def _interfaces(host: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``host.nics.interfaces`` and ``host.infiniband.ports`` (``mlx5_0/1``: same keys) of a heartbeat,
    or nothing when absent or unavailable."""
    out: dict[str, dict[str, Any]] = {}
    for collector, key in (("nics", "interfaces"), ("infiniband", "ports")):
        section = (host or {}).get(collector)
        entries = section.get(key) if isinstance(section, dict) else None
        if isinstance(entries, dict):
            out.update({str(k): v for k, v in entries.items() if isinstance(v, dict)})
    return out


def make_registry(sessions: sessionmaker[Session], *, max_jobs: int = 20, max_ranks: int = 32) -> CollectorRegistry:
    """A registry of its own (not the process-global one) holding a :class:`VigilCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VigilCollector(sessions, max_jobs=max_jobs, max_ranks=max_ranks))
    registry.register(ProcessCollector())
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus' text exposition format."""
    return generate_latest(registry)


__all__ = ["LABEL_MAX", "MAX_INTERFACES", "MAX_KINDS", "MONITOR_LAST_PASS_SECONDS", "MONITOR_PASS_SECONDS", "ProcessCollector", "VigilCollector", "make_registry", "render"]
