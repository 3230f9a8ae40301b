"""Shared pieces of the namespace tests: networks that are always removed, ranks in namespaces, samplers.

Everything here needs root and iproute2 (``ip``, ``tc``); :func:`skip_reason` says why not.
Traffic only goes between namespaces these tests create, on addresses from 198.18.0.0/15.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ops import netns
from vigil.bench.netns_ranks import enter_namespace, nic_bytes
from vigil.bench.ranks import run_ranks
from vigil.comm import Comm

ROOT = Path(__file__).resolve().parents[2]


def skip_reason() -> str | None:
    return netns.unavailable_reason()


@contextmanager
def network(home: Path, nodes: int, link: netns.LinkSpec) -> Iterator[netns.NetnsCluster]:
    """A namespace network that is removed afterwards, whatever happens; asserts nothing of it is left."""
    net = netns.create(home, nodes, link)
    record = net.record()
    try:
        yield net
    finally:
        net.destroy()
        deadline = time.monotonic() + 10
        while netns.leftovers(record) and time.monotonic() < deadline:
            time.sleep(0.2)


def in_namespaces(net: netns.NetnsCluster, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
    """``fn(rank, world, *args)`` on one gloo rank per node of ``net``, each inside its node's namespace."""
    names = tuple(n.namespace for n in net.nodes)
    return run_ranks(len(names), fn, *args, timeout=timeout, setup=partial(enter_namespace, names),
                     master_addr=net.nodes[0].address)


def agent_view(node: netns.NodeNet) -> dict[str, Any]:
    """One reading of the agent's NIC collector inside ``node``'s namespace (``host["nics"]`` of a heartbeat)."""
    code = "import json; from agent.collectors import NicCollector; print(json.dumps(NicCollector().collect()))"
    r = subprocess.run(node.exec_argv([sys.executable, "-c", code]), capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


class Samplers:
    """One :mod:`tests.netns.sampler` process per node, started now, read back with :meth:`read`."""

    def __init__(self, net: netns.NetnsCluster, folder: Path, interval: float, duration: float) -> None:
        self.paths = {n.index: folder / f"sampler-n{n.index}.jsonl" for n in net.nodes}
        self.procs = [
            subprocess.Popen(n.exec_argv([sys.executable, "-m", "tests.netns.sampler", str(self.paths[n.index]),
                                          str(interval), str(duration)]),
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            for n in net.nodes
        ]

    def read(self) -> dict[int, list[dict[str, Any]]]:
        return {i: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
                for i, p in self.paths.items()}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread now; the returned callable joins it and returns (or raises) its result."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the joiner
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join(timeout: float = 600.0) -> Any:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("ranks still running")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


# --------------------------------------------------------------------------------------------------
# Rank functions (module level: run_ranks pickles them by reference)
# --------------------------------------------------------------------------------------------------


def timed_all_reduce(rank: int, world: int, nbytes: int, repeats: int) -> dict[str, Any]:
    """``repeats`` all-reduces of ``nbytes`` through the communication layer: times, reported and NIC bytes."""
    comm = Comm.from_process_group()
    x = torch.ones(nbytes // 4)
    comm.all_reduce(x.clone(), tag="warmup")
    comm.drain()
    dist.barrier()
    tx0, rx0 = nic_bytes()
    times = []
    for i in range(repeats):
        comm.set_step(i)
        t0 = time.perf_counter()
        comm.all_reduce(x.clone(), tag="grads")
        times.append(time.perf_counter() - t0)
    records = comm.drain()
    dist.barrier()
    # A shaped link's qdisc may still hold this rank's last segments when its all-reduce returns
    # (it returns once it has received, not once its own sends left the NIC): read the counters
    # once they have settled. The barrier's few hundred bytes are inside the tests' overhead bound.
    tx1, rx1 = nic_bytes()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = nic_bytes()
        if now == (tx1, rx1):
            break
        tx1, rx1 = now
    return {"pid": os.getpid(), "times": times, "wire_bytes": sum(r.wire_bytes for r in records),
            "payload_bytes": sum(r.payload_bytes for r in records), "tx": tx1 - tx0, "rx": rx1 - rx0}


def training_like(rank: int, world: int, duration_s: float, nbytes: int, compute_n: int,
                  started: str | None = None) -> list[dict[str, Any]]:
    """Steps of compute (a matmul chain) then a gradient-sized all-reduce, for ``duration_s`` of rank 0's clock.

    Every rank runs the same number of steps: rank 0 decides when to stop and says so in the same
    all-reduce. Rank 0 creates the file ``started`` when the first step begins. Returns one record
    per step with the telemetry a rank reports (times in seconds).
    """
    comm = Comm.from_process_group()
    grads = torch.zeros(nbytes // 4)
    a = torch.randn(compute_n, compute_n)
    steps = []
    dist.barrier()
    if rank == 0 and started:
        Path(started).touch()
    start = time.monotonic()
    step = 0
    while True:
        step += 1
        comm.set_step(step)
        t0 = time.perf_counter()
        b = a
        for _ in range(4):
            b = torch.tanh(b @ a) / compute_n
        t1 = time.perf_counter()
        grads[0] = 1.0 if (rank == 0 and time.monotonic() - start >= duration_s) else 0.0
        comm.all_reduce(grads, tag="grads")
        t2 = time.perf_counter()
        steps.append({"step": step, "ts": time.time(), "fwd_bwd_s": t1 - t0, "comm_s": t2 - t1,
                      "step_time_s": t2 - t0})
        comm.drain()
        if grads[0].item() > 0:
            return steps
