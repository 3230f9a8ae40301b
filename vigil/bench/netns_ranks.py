"""Ranks in network namespaces: each rank process enters its node's namespace before joining gloo.

Used with :func:`vigil.bench.ranks.run_ranks` (``setup=partial(enter_namespace, names)``,
``master_addr=`` rank 0's eth0 address) by ``vigil bench speedup`` and the netns tests: plain
torch.distributed processes, one per namespace, with gloo on that namespace's ``eth0`` - the same
traffic a Ray Train job makes, without Ray's start-up on a two-core machine. Needs root (setns).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

CLONE_NEWNET = 0x40000000


def enter_namespace(namespaces: Sequence[str], rank: int, iface: str = "eth0") -> None:
    """Move this (single-threaded, just forked) process into ``namespaces[rank]``; gloo then uses ``iface``."""
    path = Path("/run/netns") / namespaces[rank]
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = iface


def nic_bytes(iface: str = "eth0") -> tuple[int, int]:
    """(tx, rx) byte counters of ``iface`` in this process's namespace (``/proc/self/net/dev``)."""
    from vigil.contract.link import parse_proc_net_dev

    c = parse_proc_net_dev(Path("/proc/self/net/dev").read_text())[iface]
    return c["tx_bytes"], c["rx_bytes"]
