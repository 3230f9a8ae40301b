"""A real multi-host network on one machine: one network namespace per node, shaped with ``tc``.

Layout of one run (``run_id``: 6 hex digits, so that concurrent runs never share a name)::

    root namespace                               namespace vigil-<run_id>-n<i>
    bridge vgb<run_id>  198.18.<k>.1/24  <---->  vgv<run_id><i> == eth0  198.18.<k>.<10+i>/24   (veth pair)
                                                                   lo up

Every run gets its own /24 out of 198.18.0.0/15 (RFC 2544's range for network benchmarks: never
routed), chosen under a lock among the subnets no interface of the root namespace uses yet.

Link shaping (:func:`apply_shape`) happens inside the node's namespace, so the node's agent (which
runs there) can change it for network faults and restore it with the same function:

* egress of ``eth0``: HTB, class ``1:1`` at the link rate (a slow NIC pushes back on TCP as a real
  one does), an optional ``netem`` leaf for latency and jitter, a drop class ``1:99`` (a
  ``pfifo limit 0``) for a partition;
* ingress of ``eth0``: redirected (``mirred``) to ``ifb0`` in the namespace, shaped there at the same
  rate (full-duplex links: a node can no more receive than send faster than its NIC), with the same
  drop class for a partition;
* loss: egress packets are redirected to ``ifb1`` where a classic-BPF filter sends a random
  ``percent`` of them to the drop class. The drop happens after TCP handed the packet over, as on a
  lossy wire (a drop in the sender's own qdisc would only stall TCP, never make it retransmit);
  segmentation offload is limited to one segment while loss is on, so ``percent`` counts packets.

Kernels without ``sch_netem`` (this project's build machine has none) cannot add latency: asking for
it raises :class:`NetnsError` saying so. Everything a run creates is listed in a state file before
it is created (``<home>/run/netns.json`` and a machine-wide copy under ``/run/vigil-netns``), so
:func:`cleanup_stale` removes what a crashed run left, and only that.

Needs root, Linux, ``ip`` and ``tc`` (iproute2); :func:`unavailable_reason` says what is missing.
No heavy imports: the agent uses :func:`apply_shape` and :class:`LinkSpec`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Self

log = logging.getLogger(__name__)

#: Where every run's addresses come from (RFC 2544 benchmark range; 512 /24 subnets).
POOL = ipaddress.IPv4Network("198.18.0.0/15")
#: Machine-wide registry of runs (one JSON per run), so that any later run can clean a crashed one.
REGISTRY_DIR = Path(os.environ.get("VIGIL_NETNS_REGISTRY", "/run/vigil-netns"))
IFACE = "eth0"
IFB_RX = "ifb0"
IFB_TX = "ifb1"
NS_PREFIX = "vigil-"
DROP_CLASS = "1:99"
#: Queue of each shaped direction, in time at the link rate (a switch buffer; bounded so that a
#: saturated 50 Mbit/s link does not delay an agent's heartbeat by seconds).
QUEUE_S = 0.05
MIN_QUEUE_BYTES = 128 * 1024
#: HTB bucket, in time at the link rate: large enough for the timer granularity of a busy host.
BURST_S = 0.005
MIN_BURST_BYTES = 16 * 1024
#: HTB needs a rate even for "unlimited".
UNLIMITED = "100gbit"

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)?\s*$", re.IGNORECASE)
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class NetnsError(RuntimeError):
    """A namespace or ``tc`` operation failed; the text says which command and why."""


def parse_rate(text: str) -> int:
    """Bits per second of a tc-style rate (``1gbit``, ``200mbit``, ``50Mbit``, ``10mbps``; bare: bit/s)."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"not a rate: {text!r} (e.g. 1gbit, 200mbit, 50mbit)")
    bps = int(float(m.group(1)) * _RATE_UNITS[(m.group(2) or "bit").lower()])
    if bps <= 0:
        raise ValueError(f"rate must be > 0: {text!r}")
    return bps


def parse_time_s(text: str) -> float:
    """Seconds of a tc-style time (``1ms``, ``250us``, ``0.5s``; bare: ms)."""
    m = _TIME.match(str(text))
    if not m:
        raise ValueError(f"not a time: {text!r} (e.g. 1ms, 250us)")
    return float(m.group(1)) * _TIME_UNITS[(m.group(2) or "ms").lower()]


@dataclass(frozen=True)
class LinkSpec:
    """How one node's NIC behaves. Validated on construction (``ValueError`` naming the field)."""

    rate: str | None = None
    """Bandwidth each way, tc syntax (``1gbit``); None: as fast as the veth goes."""
    latency: str | None = None
    """Added one-way delay on egress (``1ms``); needs ``sch_netem`` in the kernel."""
    jitter: str | None = None
    """Delay variation around ``latency`` (``0.2ms``); needs ``latency``."""
    loss: float = 0.0
    """Percent of egress packets lost (after TCP sent them)."""
    partitioned: bool = False
    """Drop everything, both ways (the link stays up: a silent partition)."""

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.latency is not None:
            parse_time_s(self.latency)
        if self.jitter is not None:
            if self.latency is None:
                raise ValueError("jitter: needs a latency")
            parse_time_s(self.jitter)
        if not 0.0 <= float(self.loss) <= 100.0:
            raise ValueError(f"loss: {self.loss} is not a percent in [0, 100]")

    @property
    def rate_bps(self) -> int | None:
        return parse_rate(self.rate) if self.rate else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> LinkSpec:
        if not text:
            return cls()
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError(f"a link spec must be a JSON object, got {text!r}")
        return cls(**raw)

    def with_(self, **changes: Any) -> LinkSpec:
        return replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Running ip / tc
# --------------------------------------------------------------------------------------------------

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def run_cmd(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=False, capture_output=True, text=True, timeout=30)


def _check(argv: Sequence[str], runner: Runner = run_cmd) -> str:
    r = runner(argv)
    if r.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r.stdout


def _quiet(argv: Sequence[str], runner: Runner = run_cmd) -> bool:
    """Run a command whose failure is expected and harmless (deleting what may not exist)."""
    return runner(argv).returncode == 0


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can): not Linux, not root, no ip/tc."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (creating namespaces, veths and qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2)"
    return None


def netem_available() -> str | None:
    """None if the kernel has ``sch_netem`` (latency, jitter), else why not. Probed in a scratch namespace."""
    reason = unavailable_reason()
    if reason:
        return reason
    ns = f"{NS_PREFIX}probe-{secrets.token_hex(3)}"
    try:
        _check(["ip", "netns", "add", ns])
        r = run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
        if r.returncode != 0:
            return f"the kernel has no sch_netem (latency and jitter need it): {r.stderr.strip()}"
        return None
    finally:
        _quiet(["ip", "netns", "del", ns])


# --------------------------------------------------------------------------------------------------
# Shaping one node's link (used by netns setup and by the agent's network faults)
# --------------------------------------------------------------------------------------------------


def _bytes_at(rate_bps: int, seconds: float, floor: int) -> int:
    return max(floor, int(rate_bps / 8 * seconds))


def _htb(dev: str, rate: str, prefix: list[str], *, drop_class: bool, netem: list[str] | None = None) -> list[list[str]]:
    """Root HTB on ``dev``: class 1:1 at ``rate`` (default), a byte-bounded FIFO or a netem leaf, a drop class."""
    bps = parse_rate(rate)
    burst = _bytes_at(bps, BURST_S, MIN_BURST_BYTES)
    cmds = [
        [*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "1000"],
        [*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate,
         "burst", str(burst), "cburst", str(burst), "quantum", "60000"],
    ]
    if netem:
        cmds.append([*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", *netem,
                     "limit", "10000"])
    else:
        cmds.append([*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "bfifo", "limit",
                     str(_bytes_at(bps, QUEUE_S, MIN_QUEUE_BYTES))])
    if drop_class:
        cmds += [
            [*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", DROP_CLASS, "htb", "rate", "8kbit",
             "quantum", "1500"],
            # A FIFO of length zero: whatever is classified here is dropped.
            [*prefix, "tc", "qdisc", "add", "dev", dev, "parent", DROP_CLASS, "handle", "99:", "pfifo", "limit", "0"],
        ]
    return cmds


def _match_all(dev: str, parent: str, prefix: list[str], *action: str, prio: str = "1") -> list[str]:
    return [*prefix, "tc", "filter", "add", "dev", dev, "parent", parent, "protocol", "all", "prio", prio, "u32",
            "match", "u32", "0", "0", *action]


def _random_drop_bytecode(percent: float) -> str:
    """Classic BPF: match (-1) with probability ``percent``/100 using the kernel's random ancillary load."""
    threshold = min(0xFFFFFFFF, int(percent / 100.0 * 2**32))
    ld_random = 0xFFFFF000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM
    # ld rand; jge #threshold -> no match : match
    return f"4,32 0 0 {ld_random},53 0 1 {threshold},6 0 0 0,6 0 0 4294967295"


def shape_commands(spec: LinkSpec, iface: str = IFACE, netns: str | None = None) -> list[list[str]]:
    """The ``ip``/``tc`` commands that give ``iface`` the behaviour of ``spec`` (after :func:`reset_commands`)."""
    pre = ["ip", "netns", "exec", netns] if netns else []
    cmds: list[list[str]] = []
    netem: list[str] | None = None
    if spec.latency:
        netem = ["delay", spec.latency] + ([spec.jitter, "distribution", "normal"] if spec.jitter else [])
    needs_egress = bool(spec.rate or netem or spec.partitioned or spec.loss > 0)
    if needs_egress:
        cmds += _htb(iface, spec.rate or UNLIMITED, pre, drop_class=spec.partitioned, netem=netem)
        if spec.partitioned:
            cmds.append([*_match_all(iface, "1:", pre), "flowid", DROP_CLASS])
    if spec.loss > 0 and not spec.partitioned:
        cmds += [
            [*pre, "ip", "link", "add", IFB_TX, "type", "ifb"],
            [*pre, "ip", "link", "set", IFB_TX, "up"],
            [*pre, "ip", "link", "set", iface, "gso_max_segs", "1"],
            _match_all(iface, "1:", pre, "action", "mirred", "egress", "redirect", "dev", IFB_TX),
            *_htb(IFB_TX, UNLIMITED, pre, drop_class=True),
            [*pre, "tc", "filter", "add", "dev", IFB_TX, "parent", "1:", "protocol", "all", "prio", "1", "bpf",
             "bytecode", _random_drop_bytecode(spec.loss), "flowid", DROP_CLASS],
        ]
    if spec.rate or spec.partitioned:
        cmds += [
            [*pre, "ip", "link", "add", IFB_RX, "type", "ifb"],
            [*pre, "ip", "link", "set", IFB_RX, "up"],
            [*pre, "tc", "qdisc", "add", "dev", iface, "handle", "ffff:", "ingress"],
            _match_all(iface, "ffff:", pre, "action", "mirred", "egress", "redirect", "dev", IFB_RX),
            *_htb(IFB_RX, spec.rate or UNLIMITED, pre, drop_class=spec.partitioned),
        ]
        if spec.partitioned:
            cmds.append([*_match_all(IFB_RX, "1:", pre), "flowid", DROP_CLASS])
    return cmds


def reset_commands(iface: str = IFACE, netns: str | None = None) -> list[list[str]]:
    """Commands removing every qdisc and ifb :func:`shape_commands` may have added (each may fail: nothing to remove)."""
    pre = ["ip", "netns", "exec", netns] if netns else []
    return [
        [*pre, "tc", "qdisc", "del", "dev", iface, "root"],
        [*pre, "tc", "qdisc", "del", "dev", iface, "ingress"],
        [*pre, "ip", "link", "del", IFB_RX],
        [*pre, "ip", "link", "del", IFB_TX],
        [*pre, "ip", "link", "set", iface, "gso_max_segs", "65535"],
    ]


def apply_shape(spec: LinkSpec, iface: str = IFACE, netns: str | None = None, runner: Runner = run_cmd) -> list[str]:
    """Give ``iface`` (in ``netns``, or in this process's namespace) exactly the behaviour of ``spec``.

    Replaces whatever shaping was there. Returns the commands run. Raises :class:`NetnsError` (with
    tc's reason, e.g. no ``sch_netem``) after restoring an unshaped link.
    """
    for cmd in reset_commands(iface, netns):
        _quiet(cmd, runner)
    done: list[str] = []
    try:
        for cmd in shape_commands(spec, iface, netns):
            _check(cmd, runner)
            done.append(" ".join(cmd))
    except NetnsError:
        for cmd in reset_commands(iface, netns):
            _quiet(cmd, runner)
        raise
    return done


def set_link(up: bool, iface: str = IFACE, netns: str | None = None, runner: Runner = run_cmd) -> None:
    pre = ["ip", "netns", "exec", netns] if netns else []
    _check([*pre, "ip", "link", "set", iface, "up" if up else "down"], runner)


def qdisc_stats(iface: str = IFACE, netns: str | None = None, runner: Runner = run_cmd) -> list[dict[str, Any]]:
    """``tc -s -j qdisc show dev iface`` as parsed JSON (empty when tc cannot say)."""
    pre = ["ip", "netns", "exec", netns] if netns else []
    r = runner([*pre, "tc", "-s", "-j", "qdisc", "show", "dev", iface])
    if r.returncode != 0:
        return []
    try:
        out = json.loads(r.stdout or "[]")
    except ValueError:
        return []
    return out if isinstance(out, list) else []


# --------------------------------------------------------------------------------------------------
# Namespaces of one run
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeNet:
    """One node's namespace and NIC."""

    index: int
    namespace: str
    address: str
    host_veth: str
    iface: str = IFACE

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace (``ip netns exec`` also gives it the namespace's /sys)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class NetnsCluster:
    """The network of one run: a bridge in the root namespace and one namespace per node."""

    run_id: str
    bridge: str
    gateway: str
    """The bridge's address: where the namespaces reach the root namespace (Ray head, controller)."""
    prefix_len: int
    nodes: list[NodeNet]
    link: LinkSpec
    state_file: Path
    owner_pid: int = field(default_factory=os.getpid)
    owner_started: float = 0.0

    def node(self, index: int) -> NodeNet:
        for n in self.nodes:
            if n.index == index:
                return n
        raise KeyError(index)

    def shape(self, index: int, spec: LinkSpec) -> list[str]:
        """Re-shape node ``index``'s link from outside its namespace."""
        return apply_shape(spec, IFACE, self.node(index).namespace)

    def record(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "bridge": self.bridge, "gateway": self.gateway, "prefix_len": self.prefix_len,
                "nodes": [asdict(n) for n in self.nodes], "link": asdict(self.link), "owner_pid": self.owner_pid,
                "owner_started": self.owner_started, "state_file": str(self.state_file)}

    def destroy(self) -> None:
        destroy_record(self.record())
        _forget(self.state_file, self.run_id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def state_file_for(home: Path) -> Path:
    return Path(home) / "run" / "netns.json"


@contextlib.contextmanager
def _locked(path: Path):  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_state(state_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {"runs": {}}
    return data if isinstance(data, dict) and isinstance(data.get("runs"), dict) else {"runs": {}}


def _remember(state_file: Path, record: dict[str, Any]) -> None:
    with _locked(state_file.with_suffix(".lock")):
        state = _read_state(state_file)
        state["runs"][record["run_id"]] = record
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state, indent=1))
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    (REGISTRY_DIR / f"{record['run_id']}.json").write_text(json.dumps(record))


def _forget(state_file: Path, run_id: str) -> None:
    with _locked(state_file.with_suffix(".lock")):
        state = _read_state(state_file)
        if state["runs"].pop(run_id, None) is not None:
            state_file.write_text(json.dumps(state, indent=1))
    (REGISTRY_DIR / f"{run_id}.json").unlink(missing_ok=True)


def _used_subnets() -> set[ipaddress.IPv4Network]:
    """/24s of the pool that an interface of the root namespace already uses."""
    used: set[ipaddress.IPv4Network] = set()
    try:
        links = json.loads(_check(["ip", "-j", "-4", "addr", "show"]) or "[]")
    except (NetnsError, ValueError):
        links = []
    for link in links:
        for a in link.get("addr_info", []):
            try:
                net = ipaddress.IPv4Interface(f"{a['local']}/{a.get('prefixlen', 32)}").network
            except (KeyError, ValueError):
                continue
            if net.overlaps(POOL):
                used.update(s for s in POOL.subnets(new_prefix=24) if s.overlaps(net))
    for path in REGISTRY_DIR.glob("*.json") if REGISTRY_DIR.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            used.add(ipaddress.IPv4Network(f"{json.loads(path.read_text())['gateway']}/24", strict=False))
    return used


def _process_started(pid: int) -> float:
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone or unreadable: "not running"
        return 0.0


def _owner_alive(record: dict[str, Any]) -> bool:
    pid = int(record.get("owner_pid", 0))
    if pid <= 0:
        return False
    started = _process_started(pid)
    return started > 0 and abs(started - float(record.get("owner_started", 0.0))) < 2.0


def create(home: Path, nodes: int, link: LinkSpec | None = None, *, runner: Runner = run_cmd) -> NetnsCluster:
    """Create the bridge and ``nodes`` namespaces (indices 1..nodes), shape every link with ``link``.

    Everything is recorded before it is created; on any failure what exists is removed again.
    """
    reason = unavailable_reason()
    if reason:
        raise NetnsError(reason)
    if nodes < 1 or nodes > 200:
        raise ValueError(f"nodes: {nodes} is not in 1..200")
    link = link or LinkSpec()
    if link.latency:
        why = netem_available()
        if why:
            raise NetnsError(f"--link-latency {link.latency}: {why}")
    state_file = state_file_for(home)
    run_id = secrets.token_hex(3)
    with _locked(REGISTRY_DIR / ".lock"):
        used = _used_subnets()
        free = [s for s in POOL.subnets(new_prefix=24) if s not in used]
        if not free:
            raise NetnsError(f"no free /24 left in {POOL}")
        subnet = free[0]
        hosts = list(subnet.hosts())
        gateway = str(hosts[0])
        cluster = NetnsCluster(
            run_id=run_id, bridge=f"vgb{run_id}", gateway=gateway, prefix_len=24,
            nodes=[NodeNet(i, f"{NS_PREFIX}{run_id}-n{i}", str(hosts[9 + i]), f"vgv{run_id}{i}") for i in
                   range(1, nodes + 1)],
            link=link, state_file=state_file, owner_started=_process_started(os.getpid()),
        )
        _remember(state_file, cluster.record())
        try:
            _check(["ip", "link", "add", cluster.bridge, "type", "bridge"], runner)
            _check(["ip", "addr", "add", f"{gateway}/24", "dev", cluster.bridge], runner)
            _check(["ip", "link", "set", cluster.bridge, "up"], runner)
        except BaseException:
            cluster.destroy()
            raise
    try:
        for n in cluster.nodes:
            _check(["ip", "netns", "add", n.namespace], runner)
            _check(["ip", "link", "add", n.host_veth, "type", "veth", "peer", "name", IFACE, "netns", n.namespace],
                   runner)
            _check(["ip", "link", "set", n.host_veth, "master", cluster.bridge, "up"], runner)
            _check(["ip", "-n", n.namespace, "addr", "add", f"{n.address}/24", "dev", IFACE], runner)
            _check(["ip", "-n", n.namespace, "link", "set", IFACE, "up"], runner)
            _check(["ip", "-n", n.namespace, "link", "set", "lo", "up"], runner)
            apply_shape(link, IFACE, n.namespace, runner)
    except BaseException:
        cluster.destroy()
        raise
    log.info("netns run %s: bridge %s %s/24, %d namespace(s), link %s", run_id, cluster.bridge, gateway, nodes,
             link)
    return cluster


def _namespace_pids(ns: str) -> list[int]:
    r = run_cmd(["ip", "netns", "pids", ns])
    return [int(p) for p in r.stdout.split() if p.strip().isdigit()] if r.returncode == 0 else []


def destroy_record(record: dict[str, Any], wait_s: float = 10.0) -> None:
    """Remove one run's processes (those inside its namespaces), namespaces, veths and bridge. Idempotent."""
    namespaces = [n["namespace"] for n in record.get("nodes", [])]
    for ns in namespaces:
        for pid in _namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(_namespace_pids(ns) for ns in namespaces) and time.monotonic() < deadline:
        time.sleep(0.1)
    for ns in namespaces:
        _quiet(["ip", "netns", "del", ns])
    for n in record.get("nodes", []):
        _quiet(["ip", "link", "del", n["host_veth"]])
    if record.get("bridge"):
        _quiet(["ip", "link", "del", record["bridge"]])


def leftovers(record: dict[str, Any]) -> list[str]:
    """What of a run still exists (namespaces, links): empty once it is fully gone."""
    existing_ns = set(run_cmd(["ip", "netns", "list"]).stdout.split())
    left = [f"netns {n['namespace']}" for n in record.get("nodes", []) if n["namespace"] in existing_ns]
    links = run_cmd(["ip", "-o", "link", "show"]).stdout
    names = {line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line}
    left += [f"link {name}" for name in [record.get("bridge"), *(n["host_veth"] for n in record.get("nodes", []))]
             if name in names]
    return left


def cleanup_stale(home: Path | None = None) -> int:
    """Remove every recorded run whose owner process is gone (from ``home``'s state file and the registry).

    Returns how many runs were removed. Only names recorded by this module are ever touched.
    """
    if unavailable_reason():
        return 0
    records: dict[str, dict[str, Any]] = {}
    if home is not None:
        records.update(_read_state(state_file_for(home))["runs"])
    if REGISTRY_DIR.is_dir():
        for path in REGISTRY_DIR.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                rec = json.loads(path.read_text())
                records.setdefault(rec["run_id"], rec)
    removed = 0
    for run_id, rec in records.items():
        if _owner_alive(rec):
            continue
        log.warning("removing network namespaces of crashed run %s (owner pid %s gone)", run_id, rec.get("owner_pid"))
        destroy_record(rec)
        _forget(Path(rec.get("state_file") or state_file_for(home or Path("."))), run_id)
        removed += 1
    return removed
