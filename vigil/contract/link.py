"""One network interface's link, shaped with ``tc`` and read from ``/proc/net/dev``: what the agent
(network faults inside its node's namespace), the benches and ``vigil up --netns`` share.

Shaping (:func:`apply_shape`), inside a node's namespace or the root one:

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

Kernels without ``sch_netem`` cannot add latency: asking for it raises :class:`NetnsError` saying so.
Needs root, Linux, ``ip`` and ``tc`` (iproute2) to shape; :func:`unavailable_reason` says what is
missing. Standard library only (the agent imports it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

log = logging.getLogger(__name__)

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
# Counters
# --------------------------------------------------------------------------------------------------

_RX_FIELDS = ("bytes", "packets", "errs", "drop", "fifo", "frame", "compressed", "multicast")
_TX_FIELDS = ("bytes", "packets", "errs", "drop", "fifo", "colls", "carrier", "compressed")


def parse_proc_net_dev(text: str) -> dict[str, dict[str, int]]:
    """Counters per interface from the text of ``/proc/net/dev`` (``rx_bytes``, ``tx_errs``, ...)."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or "|" in line:  # the two header lines
            continue
        values = rest.split()
        if len(values) < len(_RX_FIELDS) + len(_TX_FIELDS):
            continue
        try:
            numbers = [int(v) for v in values]
        except ValueError:
            continue
        counters = {f"rx_{f}": v for f, v in zip(_RX_FIELDS, numbers[:8])}
        counters.update({f"tx_{f}": v for f, v in zip(_TX_FIELDS, numbers[8:16])})
        out[name.strip()] = counters
    return out
