"""NIC detector: sick links from the agents' heartbeats, and communication-slow ranks behind them.

Called by the monitor once per pass for every running job (``NicDetector.detect(session, job, now)``
or :func:`detect_nic`); it only reads and returns :class:`NicFinding` s, the monitor turns them into
incidents. It keeps a short history of each node's heartbeat NIC data (only the newest heartbeat is
stored in the database), one observation per heartbeat.

What it compares, among the nodes that hold the job's ranks (a node's *primary* interface: the
shaped link of a ``--netns`` node, else its busiest physical-looking NIC):

* ``link-down``: the interface's operstate is not ``up`` in the newest heartbeat;
* ``link-flap``: its ``carrier_changes`` counter went up within ``flap_window_s`` (a link that went
  down and came back; the kernel counts both edges);
* ``nic-errors``: errors or drops per second above ``error_rate`` in k of the last m heartbeats and
  above 3x the peers' median;
* ``retransmits``: the node's TCP retransmit ratio (segments retransmitted / sent, from the agent's
  ``nics.tcp``) at least ``retrans_ratio`` and ``retrans_peer_factor`` x the peers' median in k of m
  heartbeats: packets lost on the node's link or beyond it (the NIC's own counters stay clean when
  the wire drops them; the sender retransmits). Not where another node's link is found sick in the
  same pass: a sender also retransmits what a degraded receiver's queue dropped;
* ``capacity``: the link's rate (the shaped rate of a ``--netns`` link, else ``speed_mbps``) below
  ``capacity_ratio`` x the peers' median in k of m heartbeats (a NIC renegotiated down, a degraded
  link);
* ``saturated``: throughput / capacity above ``saturation`` while the peers' median stays below
  ``peer_saturation`` and the node moves no more than ``busier_ratio`` x the peers' bytes, in k of m
  heartbeats: this node's link is the bottleneck of a synchronous collective (in a ring every node
  moves the same bytes, so only the one at its limit stands out). The shaper's hold-backs
  (``overlimits``) are evidence only: they come in bursts on healthy links too.

A NIC finding is ``nic_degraded`` with the node, its ranks and the numbers. When the job's own
telemetry shows that communication is what got slower - the median rank's time in collectives grew
``comm_growth`` x over its baseline (the job's earlier steps) while compute stayed within
``compute_growth`` x, or collectives take most of the step (``comm_share``) - each rank on a node
with a ``capacity``/``saturated``/``link-flap``/``nic-errors``/``retransmits`` finding is also named a
``straggler`` of class ``communication-slow`` (C4's split: compute-slow ranks are the monitor's
straggler detector's).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controller.locate import rank_locations
from controller.models import Job, Node, StepMetric
from vigil.contract.schemas import IncidentKind

#: Interfaces that are never a node's network link.
_VIRTUAL_PREFIXES = ("lo", "ifb", "veth", "docker", "br-", "virbr", "vgb", "vgv", "cni", "flannel", "tun", "tap")
_DOWN = ("down", "lowerlayerdown", "notpresent", "dormant")
#: Classes of NIC finding that make the node's ranks communication-slow.
COMM_CLASSES = ("capacity", "saturated", "link-flap", "nic-errors", "retransmits", "link-down")


@dataclass(frozen=True)
class NicThresholds:
    """Defaults of the NIC detector (documented in docs/RECOVERY.md)."""

    k: int = 3  # a condition must hold in k ...
    m: int = 5  # ... of the last m heartbeats of the node
    capacity_ratio: float = 0.5  # link rate below this x the peers' median: degraded
    saturation: float = 0.7  # throughput / capacity above this ...
    peer_saturation: float = 0.5  # ... while the peers' median stays below this: the bottleneck ...
    busier_ratio: float = 1.5  # ... unless it moves more than this x the peers' median bytes (load, not a sick link)
    error_rate: float = 1.0  # errors or drops per s
    retrans_ratio: float = 0.01  # TCP segments retransmitted / sent at least this ...
    retrans_peer_factor: float = 5.0  # ... and this x the peers' median: a lossy link
    flap_window_s: float = 60.0  # carrier changes within this window are a flap
    comm_growth: float = 1.5  # communication-slow: collectives' time this x its baseline ...
    compute_growth: float = 1.25  # ... while compute stays within this x its baseline
    comm_share: float = 0.5  # ... or collectives take at least this share of the step
    baseline_steps: int = 5  # the job's first steps in the window are its baseline
    recent_steps: int = 5  # compared with its newest steps
    history: int = 120  # observations kept per node
    max_age_s: float = 10.0  # observations older than this (a node gone quiet) are not judged


@dataclass(frozen=True)
class Observation:
    """One heartbeat's view of a node's primary interface."""

    ts: float
    iface: str | None
    operstate: str | None = None
    carrier_changes: int | None = None
    tx_bps: float | None = None
    rx_bps: float | None = None
    errors_per_s: float | None = None
    drops_per_s: float | None = None
    capacity_bps: float | None = None
    overlimits_per_s: float | None = None
    retrans_ratio: float | None = None

    @property
    def utilization(self) -> float | None:
        if self.capacity_bps is None or self.capacity_bps <= 0 or self.tx_bps is None or self.rx_bps is None:
            return None
        return max(self.tx_bps, self.rx_bps) / self.capacity_bps


@dataclass
class NicFinding:
    """What the detector found: an incident for the monitor to open."""

    kind: IncidentKind
    node_id: str
    rank: int | None
    cls: str
    evidence: dict[str, Any] = field(default_factory=dict)


def primary_interface(nics: dict[str, Any], link: dict[str, Any] | None) -> str | None:
    """The node's network link: the shaped one if there is one, else the physical NIC with most traffic."""
    if link and link.get("available") and link.get("iface") in nics:
        return str(link["iface"])
    best, best_bytes = None, -1
    for name, m in nics.items():
        if name.startswith(_VIRTUAL_PREFIXES) or not isinstance(m, dict):
            continue
        total = int(m.get("rx_bytes") or 0) + int(m.get("tx_bytes") or 0)
        if total > best_bytes:
            best, best_bytes = name, total
    return best


def observe(host: dict[str, Any], ts: float) -> Observation:
    """The observation of one heartbeat's ``host`` metrics (``nics`` and, on --netns nodes, ``link``)."""
    nics = ((host or {}).get("nics") or {}).get("interfaces") or {}
    link = (host or {}).get("link") if isinstance((host or {}).get("link"), dict) else None
    iface = primary_interface(nics, link)
    if iface is None:
        return Observation(ts, None)
    m = nics[iface]

    def rate(*keys: str) -> float | None:
        vals = [m.get(k) for k in keys]
        return None if any(v is None for v in vals) else float(sum(vals))  # type: ignore[arg-type]

    capacity: float | None = None
    overlimits: float | None = None
    if link and link.get("available") and link.get("iface") == iface:
        if link.get("rate_bps"):
            capacity = float(link["rate_bps"])
        egress = link.get("egress") or {}
        if egress.get("overlimits_per_s") is not None:
            overlimits = float(egress["overlimits_per_s"])
    if capacity is None and m.get("speed_mbps"):
        capacity = float(m["speed_mbps"]) * 1e6
    tx, rx = m.get("tx_bytes_per_s"), m.get("rx_bytes_per_s")
    tcp = ((host or {}).get("nics") or {}).get("tcp") or {}
    retrans = tcp.get("retrans_ratio") if isinstance(tcp, dict) else None
    return Observation(
        ts=ts, iface=iface, operstate=m.get("operstate"), carrier_changes=m.get("carrier_changes"),
        tx_bps=None if tx is None else 8.0 * tx, rx_bps=None if rx is None else 8.0 * rx,
        errors_per_s=rate("rx_errors_per_s", "tx_errors_per_s"), drops_per_s=rate("rx_dropped_per_s", "tx_dropped_per_s"),
        capacity_bps=capacity, overlimits_per_s=overlimits,
        retrans_ratio=float(retrans) if isinstance(retrans, int | float) else None,
    )


def _nic_finding(out: list[NicFinding], node: str, ranks: list[int], base: dict[str, Any], cls: str,
                 **ev: Any) -> None:
    out.append(NicFinding(IncidentKind.NIC_DEGRADED, node, ranks[0] if len(ranks) == 1 else None, cls,
                          {"class": cls, **base, **ev}))


def _throughput(o: Observation) -> float | None:
    return None if o.tx_bps is None or o.rx_bps is None else max(o.tx_bps, o.rx_bps)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


class NicDetector:
    """The detector with its per-node history; ``detect`` is one pass for one job."""

    def __init__(self, thresholds: NicThresholds | None = None) -> None:
        self.th = thresholds or NicThresholds()
        self.history: dict[str, deque[Observation]] = defaultdict(lambda: deque(maxlen=self.th.history))
        self._held: dict[str, set[str]] = {}  # job -> the nodes that held its ranks in the last pass

    # -- input ------------------------------------------------------------------------------------
    def record(self, node_id: str, host: dict[str, Any], ts: float) -> None:
        """Add one heartbeat of ``node_id`` (ignored if this heartbeat was seen already)."""
        h = self.history[node_id]
        if h and h[-1].ts >= ts:
            return
        h.append(observe(host, ts))

    def _record_nodes(self, session: Session, node_ids: set[str]) -> None:
        for node in session.scalars(select(Node).where(Node.id.in_(node_ids))).all():
            if node.last_heartbeat is not None:
                self.record(node.id, node.host or {}, node.last_heartbeat.timestamp())

    # -- one pass ---------------------------------------------------------------------------------
    def detect(self, session: Session, job: Job, now: float) -> list[NicFinding]:
        """Findings for ``job``: NIC problems of the nodes holding its ranks, and the ranks they slow down."""
        locs = rank_locations(session, job.id)
        ranks_by_node: dict[str, list[int]] = defaultdict(list)
        for rank, loc in sorted(locs.items()):
            ranks_by_node[loc.node_id].append(rank)
        # A node that no longer holds the job's ranks (evicted, or the group restarted elsewhere) is
        # judged afresh if they come back: what it showed before (a degraded link since cleared, a flap
        # already acted on) is not evidence against it then.
        for gone in self._held.get(job.id, set()) - set(ranks_by_node):
            self.history.pop(gone, None)
        self._held[job.id] = set(ranks_by_node)
        if not ranks_by_node:
            return []
        self._record_nodes(session, set(ranks_by_node))
        findings = self.nic_findings(dict(ranks_by_node), now)
        comm = self.comm_slowdown(session, job)
        if comm is not None:
            named: set[str] = set()
            for f in list(findings):
                if f.cls not in COMM_CLASSES or f.node_id in named:
                    continue
                named.add(f.node_id)  # its first NIC finding is the evidence; incidents() lists them all
                for rank in ranks_by_node.get(f.node_id, []):
                    findings.append(NicFinding(IncidentKind.STRAGGLER, f.node_id, rank, "communication-slow",
                                               {"class": "communication-slow", "rank": rank, **comm,
                                                "nic": {"class": f.cls, **f.evidence}}))
        return findings

    def nic_findings(self, ranks_by_node: dict[str, list[int]], now: float) -> list[NicFinding]:
        """NIC findings from the recorded history alone (no database)."""
        th = self.th
        out: list[NicFinding] = []
        signs: set[str] = set()  # nodes whose newest heartbeat already shows a slow link (not yet k of m)
        nodes = list(ranks_by_node)
        windows = {n: [o for o in list(self.history.get(n, ()))[-th.m:] if o.ts >= now - th.max_age_s] for n in nodes}
        for node in nodes:
            win = windows[node]
            if not win:
                continue
            latest = win[-1]
            peers = [p for p in nodes if p != node]
            ranks = ranks_by_node[node]
            base = {"iface": latest.iface, "ranks": ranks}

            add = partial(_nic_finding, out, node, ranks, base)
            if latest.operstate and latest.operstate.lower() in _DOWN:
                add("link-down", operstate=latest.operstate)
            flap = self._carrier_changes(node, now)
            if flap:
                add("link-flap", carrier_changes=flap[0], window_s=th.flap_window_s, first=flap[1], last=flap[2])
            # The conditions below hold "in k of the last m heartbeats", each heartbeat against the
            # peers' observations nearest in time.
            errs = [o for o in win if max(o.errors_per_s or 0.0, o.drops_per_s or 0.0) >= th.error_rate
                    and max(o.errors_per_s or 0.0, o.drops_per_s or 0.0)
                    > 3 * (self._peer_median(peers, o.ts, lambda x: max(x.errors_per_s or 0.0, x.drops_per_s or 0.0))
                           or 0.0)]
            if len(errs) >= th.k:
                add("nic-errors", errors_per_s=_r(errs[-1].errors_per_s), drops_per_s=_r(errs[-1].drops_per_s),
                    heartbeats=f"{len(errs)}/{len(win)}")
            if not peers:
                continue
            lossy = []
            for o in win:
                if o.retrans_ratio is None or o.retrans_ratio < th.retrans_ratio:
                    continue
                peer_retrans = self._peer_median(peers, o.ts, lambda x: x.retrans_ratio)
                if peer_retrans is None or o.retrans_ratio >= th.retrans_peer_factor * peer_retrans:
                    lossy.append((o, peer_retrans))
            if len(lossy) >= th.k:
                o, peer_retrans = lossy[-1]
                add("retransmits", retrans_ratio=_r(o.retrans_ratio, 4), peers_median_retrans_ratio=_r(peer_retrans, 4),
                    threshold=th.retrans_ratio, heartbeats=f"{len(lossy)}/{len(win)}")
            low = self._low_capacity(win, peers)
            if low and low[-1][0] is latest:
                signs.add(node)
            if len(low) >= th.k:
                o, peer_cap = low[-1]
                add("capacity", capacity_bps=o.capacity_bps, peers_median_capacity_bps=peer_cap,
                    ratio_to_peers=_r(o.capacity_bps / peer_cap), threshold=th.capacity_ratio,  # type: ignore[operator]
                    tx_bps=_r(o.tx_bps, 0), rx_bps=_r(o.rx_bps, 0), heartbeats=f"{len(low)}/{len(win)}")
            busy = []
            for o in win:
                util = o.utilization
                peer_util = self._peer_median(peers, o.ts, lambda x: x.utilization)
                peer_over = self._peer_median(peers, o.ts, lambda x: x.overlimits_per_s)
                # At its limit while the peers are not, yet moving no more bytes than they do: the link is
                # slow, not busier (a node that simply sends more, e.g. a parameter server, is not flagged).
                peer_bytes = self._peer_median(peers, o.ts, _throughput)
                by_util = util is not None and peer_util is not None and util >= th.saturation \
                    and peer_util < th.peer_saturation \
                    and (_throughput(o) or 0.0) <= th.busier_ratio * (peer_bytes or 0.0)
                if by_util:
                    busy.append((o, util, peer_util, peer_over))
            if len(busy) >= th.k:
                o, util, peer_util, peer_over = busy[-1]
                add("saturated", utilization=_r(util), peers_median_utilization=_r(peer_util),
                    overlimits_per_s=_r(o.overlimits_per_s, 1), peers_median_overlimits_per_s=_r(peer_over, 1),
                    tx_bps=_r(o.tx_bps, 0), rx_bps=_r(o.rx_bps, 0), capacity_bps=o.capacity_bps,
                    heartbeats=f"{len(busy)}/{len(win)}")
        return _explained(out, signs)

    def _low_capacity(self, win: list[Observation], peers: list[str]) -> list[tuple[Observation, float]]:
        """The heartbeats of ``win`` whose link rate is below ``capacity_ratio`` x the peers' median then."""
        low = []
        for o in win:
            peer_cap = self._peer_median(peers, o.ts, lambda x: x.capacity_bps)
            if o.capacity_bps is not None and peer_cap and o.capacity_bps < self.th.capacity_ratio * peer_cap:
                low.append((o, peer_cap))
        return low

    def _peer_median(self, peers: list[str], ts: float, value: Any) -> float | None:
        vals = []
        for p in peers:
            h = self.history.get(p)
            if not h:
                continue
            nearest = min(h, key=lambda o: abs(o.ts - ts))
            if abs(nearest.ts - ts) > self.th.max_age_s:
                continue  # that peer said nothing near this time
            v = value(nearest)
            if v is not None:
                vals.append(float(v))
        return _median(vals)

    def _carrier_changes(self, node: str, now: float) -> tuple[int, int, int] | None:
        """(changes, first, last counter) within the flap window, or None if the carrier held."""
        recent = [o for o in self.history.get(node, ()) if o.carrier_changes is not None
                  and o.ts >= now - self.th.flap_window_s]
        if len(recent) < 2:
            return None
        counts = [int(o.carrier_changes) for o in recent]  # type: ignore[arg-type]
        # A counter that went back means a new interface (node restarted): count rises only.
        rises = sum(max(0, b - a) for a, b in itertools.pairwise(counts))
        return (rises, counts[0], counts[-1]) if rises > 0 else None

    def comm_slowdown(self, session: Session, job: Job) -> dict[str, Any] | None:
        """Evidence that the job's communication, not its compute, got slow; None if not."""
        th = self.th
        rows = session.execute(
            select(StepMetric.step, StepMetric.rank, StepMetric.fwd_bwd_s, StepMetric.comm_s, StepMetric.step_time_s)
            .where(StepMetric.job_id == job.id).order_by(StepMetric.id.desc()).limit(400)
        ).all()
        by_step: dict[int, list[Any]] = defaultdict(list)
        for r in rows:
            if r.comm_s is not None and r.fwd_bwd_s is not None:
                by_step[r.step].append(r)
        steps = sorted(by_step)
        if len(steps) < th.recent_steps:
            return None

        def med(sts: list[int], attr: str) -> float:
            return statistics.median(statistics.median(getattr(r, attr) for r in by_step[s]) for s in sts)

        recent = steps[-th.recent_steps:]
        comm_now, compute_now = med(recent, "comm_s"), med(recent, "fwd_bwd_s")
        step_now = med(recent, "step_time_s")
        ev: dict[str, Any] = {"steps": [recent[0], recent[-1]], "comm_s": round(comm_now, 4),
                              "compute_s": round(compute_now, 4), "step_time_s": round(step_now, 4),
                              "comm_share": round(comm_now / step_now, 3) if step_now > 0 else None}
        grown = False
        if len(steps) >= th.baseline_steps + th.recent_steps:
            base = steps[: th.baseline_steps]
            comm_base, compute_base = med(base, "comm_s"), med(base, "fwd_bwd_s")
            ev.update(baseline_steps=[base[0], base[-1]], baseline_comm_s=round(comm_base, 4),
                      baseline_compute_s=round(compute_base, 4))
            grown = comm_base > 0 and comm_now >= th.comm_growth * comm_base and \
                compute_now <= th.compute_growth * max(compute_base, 1e-9)
            ev["comm_growth"] = round(comm_now / comm_base, 3) if comm_base > 0 else None
        shared = step_now > 0 and comm_now / step_now >= th.comm_share
        if not (grown or shared):
            return None
        ev["why"] = "collectives grew while compute did not" if grown else "collectives take most of the step"
        return ev


def _explained(out: list[NicFinding], signs: set[str]) -> list[NicFinding]:
    """``out`` without the retransmits that a sick link explains. A sender retransmits whatever its path
    lost, also in the receiver's full queue: a node whose own link is found sick explains its peers'
    retransmits (in a ring, the node that sends to a degraded one retransmits what the degraded one's
    ingress dropped). Only where no link is found sick do retransmits name the node that sends them. A
    link whose rate fell in its newest heartbeat (``signs``) counts already: a sender's retransmits reach
    k of m a heartbeat or two before the degraded node's own capacity does (agents beat out of phase;
    seen in CI: the sender named)."""
    sick = {f.node_id for f in out if f.cls != "retransmits"} | signs
    return [f for f in out if f.cls != "retransmits" or f.node_id in sick] if sick else out


def incidents(findings: list[NicFinding]) -> list[NicFinding]:
    """One finding per node to open as an incident: its communication-slow straggler if there is one, else
    its first NIC finding; the evidence lists every class found on the node (``nic_classes``)."""
    by_node: dict[str, list[NicFinding]] = defaultdict(list)
    for f in findings:
        by_node[f.node_id].append(f)
    out = []
    for node, fs in by_node.items():
        best = next((f for f in fs if f.kind == IncidentKind.STRAGGLER), fs[0])
        classes = sorted({f.cls for f in fs if f.kind == IncidentKind.NIC_DEGRADED})
        out.append(NicFinding(best.kind, node, best.rank, best.cls, {**best.evidence, "nic_classes": classes}))
    return out


_default = NicDetector()


def detect_nic(session: Session, job: Job, now: float, detector: NicDetector | None = None) -> list[NicFinding]:
    """One pass of the NIC detector for ``job`` (a module-wide detector keeps the history by default)."""
    return (detector or _default).detect(session, job, now)
