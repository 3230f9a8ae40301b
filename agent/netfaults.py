"""Network faults on this node's NIC (``shape_nic`` commands), carried out by the node's agent.

The agent of a namespaced node (``vigil up --netns``) runs inside that node's network namespace,
so ``ip`` and ``tc`` here act on the node's own ``eth0``. Every fault starts from the link's
current behaviour and changes one thing; ``clear`` restores the link as the cluster configured it
(``VIGIL_NIC_LINK``, a :class:`vigil.contract.link.LinkSpec` as JSON) and brings it up:

============== ===================================== =================================================
kind           params (defaults)                     what happens
============== ===================================== =================================================
degrade_nic    fraction (0.25)                       the link's rate, both ways, times ``fraction``
nic_latency    delay_ms (10), jitter_ms (0)          netem delay on egress (needs ``sch_netem``)
nic_loss       percent (1.0)                         that share of egress packets lost on the wire
flap_nic       seconds (2), times (1), up_s (2)      link down ``seconds``, up ``up_s``, ``times`` over
partition_node seconds (30)                          every packet dropped both ways, link up; lifted
                                                     after ``seconds`` by the agent itself, since a
                                                     partitioned agent cannot hear the ``clear``
clear          -                                     configured shaping back, link up, timers stopped
============== ===================================== =================================================

:func:`shape_nic` is the entry point: ``(ok, message, output)``, never raising. A node without a
configured interface (a plain ``vigil up``) answers ``ok=False`` with the reason: shaping the host's
real NIC is never done.

This module must never import torch, ray or the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vigil.contract.link import (
    IFACE,
    IFB_RX,
    NS_PREFIX,
    UNLIMITED,
    LinkSpec,
    NetnsError,
    Runner,
    apply_shape,
    parse_rate,
    run_cmd,
    set_link,
)

log = logging.getLogger(__name__)

#: The interface this agent may shape (set by ``vigil up --netns`` for agents inside a namespace).
ENV_IFACE = "VIGIL_NIC_IFACE"
#: The link as configured (JSON of :class:`LinkSpec`); ``clear`` restores it.
ENV_LINK = "VIGIL_NIC_LINK"

KINDS = ("degrade_nic", "nic_latency", "nic_loss", "flap_nic", "partition_node", "clear")
Result = tuple[bool, str, dict[str, Any]]


def _num(params: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    raw = params.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: {raw!r} is not a number") from None
    if not lo <= value <= hi:
        raise ValueError(f"{key}: {value:g} is not in [{lo:g}, {hi:g}]")
    return value


class NetFaults:
    """The network-fault state of one node: the configured link, the current one, the timers."""

    def __init__(
        self,
        iface: str = IFACE,
        base: LinkSpec | None = None,
        netns: str | None = None,
        runner: Runner = run_cmd,
        sys_root: str | Path = "/sys",
        timer: Callable[[float, Callable[[], None]], threading.Timer] = threading.Timer,
    ) -> None:
        self.iface = iface
        self.netns = netns
        self.base = base or LinkSpec()
        self.current = self.base
        self._runner = runner
        self._sys = Path(sys_root)
        self._timer = timer
        self._lock = threading.RLock()
        self._flap: threading.Thread | None = None
        self._flap_stop = threading.Event()
        self._lift: threading.Timer | None = None

    # -- entry ------------------------------------------------------------------------------------
    def run(self, args: Mapping[str, Any]) -> Result:
        kind = str(args.get("kind", ""))
        handler = {
            "degrade_nic": self.degrade, "nic_latency": self.latency, "nic_loss": self.loss,
            "flap_nic": self.flap, "partition_node": self.partition, "clear": self.clear,
        }.get(kind)
        if handler is None:
            return False, f"shape_nic: unknown kind {kind!r}; known: {', '.join(KINDS)}", {}
        params = {k: v for k, v in args.items() if k != "kind"}
        try:
            _refuse_host_namespace(self.netns)
            return handler(params)
        except (ValueError, NetnsError) as exc:
            return False, f"{kind}: {exc}", self._state()
        except Exception as exc:  # an answer, never a dead agent
            log.exception("shape_nic %s failed", kind)
            return False, f"{kind} failed: {type(exc).__name__}: {exc}", self._state()

    def _state(self, **extra: Any) -> dict[str, Any]:
        return {"iface": self.iface, "link": asdict(self.current), "configured": asdict(self.base), **extra}

    def _apply(self, spec: LinkSpec) -> list[str]:
        with self._lock:
            _refuse_host_namespace(self.netns)
            try:
                cmds = apply_shape(spec, self.iface, self.netns, self._runner)
            except NetnsError:
                # apply_shape left the link unshaped: put back what was there before this fault.
                try:
                    apply_shape(self.current, self.iface, self.netns, self._runner)
                except NetnsError as exc:
                    log.error("could not restore %s to %s: %s", self.iface, self.current, exc)
                raise
            self.current = spec
            return cmds

    def _rate_bps(self) -> int:
        """The link's current rate: the shaped one, else the interface's speed."""
        if self.current.rate:
            return parse_rate(self.current.rate)
        try:
            mbps = int((self._sys / "class" / "net" / self.iface / "speed").read_text().strip())
        except (OSError, ValueError):
            mbps = -1
        if mbps <= 0:
            raise ValueError(f"{self.iface} has neither a shaped rate nor a speed to degrade from")
        return mbps * 1_000_000

    # -- kinds ------------------------------------------------------------------------------------
    def degrade(self, params: Mapping[str, Any]) -> Result:
        fraction = _num(params, "fraction", 0.25, 1e-4, 1.0)
        with self._lock:
            before = self._rate_bps()
            rate = max(8_000, int(before * fraction))
            cmds = self._apply(self.current.with_(rate=f"{rate}bit"))
        return True, f"{self.iface}: rate {before / 1e6:g} -> {rate / 1e6:g} Mbit/s each way", \
            self._state(commands=cmds)

    def latency(self, params: Mapping[str, Any]) -> Result:
        delay = _num(params, "delay_ms", 10.0, 0.0, 60_000.0)
        jitter = _num(params, "jitter_ms", 0.0, 0.0, 60_000.0)
        spec = self.current.with_(latency=f"{delay:g}ms", jitter=f"{jitter:g}ms" if jitter > 0 else None)
        cmds = self._apply(spec)
        return True, f"{self.iface}: +{delay:g} ms (jitter {jitter:g} ms) on egress", self._state(commands=cmds)

    def loss(self, params: Mapping[str, Any]) -> Result:
        percent = _num(params, "percent", 1.0, 0.0, 100.0)
        cmds = self._apply(self.current.with_(loss=percent))
        return True, f"{self.iface}: {percent:g}% of egress packets lost", self._state(commands=cmds)

    def partition(self, params: Mapping[str, Any]) -> Result:
        seconds = _num(params, "seconds", 30.0, 0.1, 3600.0)
        with self._lock:
            cmds = self._apply(self.current.with_(partitioned=True))
            self._cancel_lift()
            self._lift = self._timer(seconds, self._lift_partition)
            self._lift.daemon = True
            self._lift.start()
        return True, f"{self.iface}: partitioned (every packet dropped both ways) for {seconds:g} s", \
            self._state(commands=cmds, seconds=seconds)

    def _lift_partition(self) -> None:
        with self._lock:
            if self.current.partitioned:
                try:
                    self._apply(self.current.with_(partitioned=False))
                    log.info("%s: partition lifted", self.iface)
                except NetnsError as exc:
                    log.error("could not lift the partition of %s: %s", self.iface, exc)

    def flap(self, params: Mapping[str, Any]) -> Result:
        seconds = _num(params, "seconds", 2.0, 0.05, 600.0)
        times = int(_num(params, "times", 1, 1, 1000))
        up_s = _num(params, "up_s", 2.0, 0.05, 600.0)
        with self._lock:
            self._stop_flap()
            self._flap_stop = threading.Event()
            self._flap = threading.Thread(target=self._flap_loop, args=(seconds, times, up_s, self._flap_stop),
                                          name=f"vigil-flap-{self.iface}", daemon=True)
            self._flap.start()
        return True, f"{self.iface}: down {seconds:g} s, {times} time(s), up {up_s:g} s between", \
            self._state(seconds=seconds, times=times, up_s=up_s)

    def _flap_loop(self, seconds: float, times: int, up_s: float, stop: threading.Event) -> None:
        for i in range(times):
            try:
                _refuse_host_namespace(self.netns)
                set_link(False, self.iface, self.netns, self._runner)
                stop.wait(seconds)
            finally:
                try:
                    set_link(True, self.iface, self.netns, self._runner)
                except NetnsError as exc:
                    log.error("could not bring %s up again: %s", self.iface, exc)
            if stop.is_set() or i == times - 1 or stop.wait(up_s):
                return

    def _stop_flap(self) -> None:
        if self._flap is not None:
            self._flap_stop.set()
            self._flap.join(timeout=10)
            self._flap = None

    def _cancel_lift(self) -> None:
        if self._lift is not None:
            self._lift.cancel()
            self._lift = None

    def clear(self, params: Mapping[str, Any] | None = None) -> Result:
        with self._lock:
            self._stop_flap()
            self._cancel_lift()
            _refuse_host_namespace(self.netns)
            set_link(True, self.iface, self.netns, self._runner)
            cmds = self._apply(self.base)
        return True, f"{self.iface}: configured link restored", self._state(commands=cmds)

    def close(self) -> None:
        """Agent shutdown: undo any fault (best effort)."""
        if self.current != self.base or self._flap is not None or self._lift is not None:
            ok, message, _ = self.run({"kind": "clear"})
            if not ok:
                log.error("could not undo network faults on %s: %s", self.iface, message)


# --------------------------------------------------------------------------------------------------
# The shaped link, as the kernel sees it (a heartbeat collector)
# --------------------------------------------------------------------------------------------------

_RATE_TEXT = re.compile(r"\brate (\S+)")
_QDISC_COUNTERS = ("bytes", "packets", "drops", "overlimits", "requeues")


class LinkCollector:
    """The node's shaped link: its rate each way and its queues' counters, from ``tc`` (heartbeat key ``link``).

    What ``ethtool`` speed and the NIC's queue counters are on a real host: ``rate_bps`` is what the
    link can carry now (a degraded NIC shows here, as a NIC renegotiated down shows in its speed;
    None where nothing limits it: the NIC's speed says then);
    ``egress``/``ingress`` are the root queues of ``eth0`` and of its ingress ``ifb0``: bytes,
    packets, drops, ``overlimits`` (packets the shaper had to hold back: the link was the
    bottleneck), ``backlog_bytes``, and per-second rates of the counters from the previous reading
    (None on the first, or after a counter went back). Never raises; no ``tc``: unavailable.
    """

    name = "link"

    def __init__(self, iface: str = IFACE, ingress: str = IFB_RX, runner: Runner = run_cmd,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.iface = iface
        self.ingress = ingress
        self._runner = runner
        self._clock = clock
        self._prev: dict[str, tuple[float, dict[str, int]]] = {}

    def collect(self) -> dict[str, Any]:
        try:
            r = self._runner(["tc", "-s", "-j", "qdisc", "show"])
            qdiscs = json.loads(r.stdout or "[]") if r.returncode == 0 else None
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            return {"available": False, "reason": f"tc: {type(exc).__name__}: {exc}"}
        if not isinstance(qdiscs, list):
            return {"available": False, "reason": f"tc -s -j qdisc show failed: {(r.stderr or '').strip()[:200]}"}
        now = self._clock()
        out: dict[str, Any] = {"available": True, "iface": self.iface, "rate_bps": self._rate()}
        for direction, dev in (("egress", self.iface), ("ingress", self.ingress)):
            root = next((q for q in qdiscs if q.get("dev") == dev and q.get("root")), None)
            out[direction] = self._queue(direction, root, now) if root else None
        return out

    def _rate(self) -> int | None:
        try:
            r = self._runner(["tc", "class", "show", "dev", self.iface, "classid", "1:1"])
        except (OSError, subprocess.SubprocessError):
            return None
        m = _RATE_TEXT.search(r.stdout or "") if r.returncode == 0 else None
        try:
            rate = parse_rate(m.group(1)) if m else None
        except ValueError:
            return None
        # A link given only loss or latency carries them in a class at the placeholder rate: no rate
        # limit, so no rate to report (the NIC's own speed is its capacity, as on the unshaped peers).
        return None if rate is not None and rate >= parse_rate(UNLIMITED) else rate

    def _queue(self, direction: str, q: dict[str, Any], now: float) -> dict[str, Any]:
        cur = {k: int(q.get(k, 0) or 0) for k in _QDISC_COUNTERS}
        m: dict[str, Any] = {"kind": q.get("kind"), **cur, "backlog_bytes": int(q.get("backlog", 0) or 0),
                             "qlen": int(q.get("qlen", 0) or 0)}
        prev = self._prev.get(direction)
        dt = now - prev[0] if prev else 0.0
        fresh = prev is None or dt <= 0 or any(cur[k] < prev[1][k] for k in _QDISC_COUNTERS)
        for k in _QDISC_COUNTERS:
            m[f"{k}_per_s"] = None if fresh else (cur[k] - prev[1][k]) / dt  # type: ignore[index]
        self._prev[direction] = (now, cur)
        return m


def node_collectors(environ: Mapping[str, str] = os.environ) -> list[LinkCollector]:
    """The collectors of a ``--netns`` node's agent (``VIGIL_NIC_IFACE`` set); none on other nodes."""
    iface = environ.get(ENV_IFACE)
    return [LinkCollector(iface)] if iface else []


def _refuse_host_namespace(netns: str | None) -> None:
    """Only ever shape a node namespace of ``vigil up --netns`` (``/run/netns/vigil-*``), never the host's NICs."""
    if netns is not None:
        if not netns.startswith(NS_PREFIX):
            raise NetnsError(f"refusing to shape namespace {netns!r}: not one of Vigil's ({NS_PREFIX}*)")
        return
    try:
        me = os.stat("/proc/self/ns/net")
    except OSError as exc:
        raise NetnsError(f"cannot tell which network namespace this is ({exc}); refusing to shape") from None
    named = Path("/run/netns")
    for path in named.glob(f"{NS_PREFIX}*") if named.is_dir() else []:
        try:
            st = path.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (me.st_dev, me.st_ino):
            return
    raise NetnsError(f"refusing to shape: this process is not inside a Vigil node namespace ({NS_PREFIX}*), "
                     "and the host's own NICs are never shaped")


_instances: dict[tuple[str, str | None], NetFaults] = {}
_instances_lock = threading.Lock()


def node_faults(iface: str | None = None, netns: str | None = None,
                environ: Mapping[str, str] = os.environ) -> NetFaults | None:
    """The :class:`NetFaults` of ``iface`` (default ``VIGIL_NIC_IFACE``; None if neither is set), one per process.

    Its configured link is ``VIGIL_NIC_LINK``.
    """
    iface = iface or environ.get(ENV_IFACE)
    if not iface:
        return None
    with _instances_lock:
        key = (iface, netns)
        if key not in _instances:
            _instances[key] = NetFaults(iface, LinkSpec.from_json(environ.get(ENV_LINK)), netns)
        return _instances[key]


def shape_nic(args: Mapping[str, Any], iface: str | None = None, netns: str | None = None) -> Result:
    """Carry out one ``shape_nic`` command on this node's interface: ``(ok, message, output)``; never raises.

    ``iface`` overrides ``VIGIL_NIC_IFACE``, ``netns`` names the namespace to act in (tests, from
    outside); without an interface nothing is shaped.
    """
    try:
        faults = node_faults(iface, netns)
    except ValueError as exc:  # a malformed VIGIL_NIC_LINK
        return False, f"shape_nic: {ENV_LINK}: {exc}", {}
    if faults is None:
        return False, (f"shape_nic: not supported on this node: no shapeable NIC ({ENV_IFACE} unset; network faults need "
                       "`vigil up --netns`)"), {}
    return faults.run(args)


def close() -> None:
    """Undo this process's network faults (agent shutdown)."""
    with _instances_lock:
        instances = list(_instances.values())
    for faults in instances:
        faults.close()
