"""A real multi-host network on one machine: one network namespace per node, shaped with ``tc``.

Layout of one run (``run_id``: 6 hex digits, so that concurrent runs never share a name)::

    root namespace                               namespace vigil-<run_id>-n<i>
    bridge vgb<run_id>  198.18.<k>.1/24  <---->  vgv<run_id><i> == eth0  198.18.<k>.<10+i>/24   (veth pair)
                                                                   lo up

Every run gets its own /24 out of 198.18.0.0/15 (RFC 2544's range for network benchmarks: never
routed), chosen under a lock among the subnets no interface of the root namespace uses yet.

Link shaping (:func:`vigil.contract.link.apply_shape`) happens inside the node's namespace, so the node's
agent (which runs there) can change it for network faults and restore it with the same function
(what the shaping is: :mod:`vigil.contract.link`).

Everything a run creates is listed in a state file before
it is created (``<home>/run/netns.json`` and a machine-wide copy under ``/run/vigil-netns``), so
:func:`cleanup_stale` removes what a crashed run left, and only that.

Needs root, Linux, ``ip`` and ``tc`` (iproute2); :func:`unavailable_reason` says what is missing.
An operator tool (``vigil up --netns``, the benches and tests); the agent needs only :mod:`vigil.contract.link`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

from vigil.contract.link import (
    IFACE,
    NS_PREFIX,
    LinkSpec,
    NetnsError,
    Runner,
    _check,
    _quiet,
    apply_shape,
    netem_available,
    run_cmd,
    unavailable_reason,
)

log = logging.getLogger(__name__)

#: Where every run's addresses come from (RFC 2544 benchmark range; 512 /24 subnets).
POOL = ipaddress.IPv4Network("198.18.0.0/15")
#: Machine-wide registry of runs (one JSON per run), so that any later run can clean a crashed one.
REGISTRY_DIR = Path(os.environ.get("VIGIL_NETNS_REGISTRY", "/run/vigil-netns"))

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
