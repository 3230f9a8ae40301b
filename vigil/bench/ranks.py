"""Run a function on N gloo ranks (processes on this machine) and collect what each rank returns.

Used by ``python -m vigil.bench comm`` and, through ``tests/vigil/optim/harness.py``, by the
multi-process tests. Needs torch with gloo and a free TCP port on 127.0.0.1 (found by binding port
0). Processes come from a ``forkserver`` that imports torch (and torch._dynamo, which the first
optimizer pulls in: seconds) once, so a 4-rank run starts in about a second instead of four fresh
``import torch``. Every run is bounded by ``timeout``: the process group's own timeout and the
parent's wait; ranks still alive at the deadline are terminated (only the processes started here)
and the run fails with what the ranks said.

``fn(rank, world_size, *args)`` must be importable by reference (a module-level function) and its
result picklable; tensors come back as tensors (serialized with ``torch.save``, not shared memory).
The calling script must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from vigil.contract.probe import free_port

# Imported once in the fork server: torch._dynamo alone takes seconds (the first optimizer pulls it in).
_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch._dynamo", "torch.nn.parallel", "pydantic"]
_PORT_IN_USE = ("Address already in use", "EADDRINUSE", "errno: 98")


class RankFailure(RuntimeError):
    """A rank raised, or the run overran its timeout."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(
    rank: int, world_size: int, port: int, timeout: float, fn: Callable[..., Any], args: tuple[Any, ...],
    results: Any, setup: Callable[[int], None] | None = None, master_addr: str = "127.0.0.1",
) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    status, payload = "error", b""
    try:
        if setup is not None:
            setup(rank)  # e.g. enter this rank's network namespace (vigil/bench/netns_ranks.py)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            payload = _dumps(fn(rank, world_size, *args))
            status = "ok"
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - whatever a rank raises goes back to the parent
        payload = traceback.format_exc().encode()
    results.put((rank, status, payload))


def _run_once(
    world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float,
    setup: Callable[[int], None] | None = None, master_addr: str = "127.0.0.1",
) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, timeout, fn, args, results, setup, master_addr),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout + 10.0
    got: dict[int, tuple[str, bytes]] = {}
    grace: float | None = None  # set once a rank has exited without reporting (crashed)
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
            except queue.Empty:
                if any(p.exitcode is not None and r not in got for r, p in enumerate(procs)):
                    grace = grace if grace is not None else time.monotonic() + 2.0
                    if time.monotonic() > grace:
                        break
                continue
            got[rank] = (status, payload)
            if status != "ok":
                # Give the others a moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    errors = {r: payload.decode(errors="replace") for r, (status, payload) in got.items() if status != "ok"}
    missing = [r for r in range(world_size) if r not in got]
    if errors or missing:
        lines = [f"rank {r} raised:\n{msg}" for r, msg in sorted(errors.items())]
        crashed = [r for r in missing if procs[r].exitcode not in (None, 0)]
        if crashed:
            lines.append(f"ranks {crashed} exited without reporting (exit codes {[procs[r].exitcode for r in crashed]})")
        hung = [r for r in missing if r not in crashed]
        if hung:
            lines.append(f"ranks {hung} did not finish within {timeout:.0f} s")
        raise RankFailure("\n".join(lines))
    return [_loads(got[r][1]) for r in range(world_size)]


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
    setup: Callable[[int], None] | None = None, master_addr: str = "127.0.0.1",
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size-1, world_size, *args)]``, each in its own process.

    Each rank runs with one intra-op thread inside an initialised gloo process group. ``setup(rank)``
    (picklable) runs in the rank's process before the group is joined at ``master_addr`` (rank 0's
    address; loopback by default). Raises
    :class:`RankFailure` with every rank's traceback if one raises, or if the run overruns ``timeout``
    seconds. Retries (twice) only when the probed port was taken before the group could bind it.
    """
    for attempt in range(3):
        try:
            return _run_once(world_size, fn, args, timeout, setup, master_addr)
        except RankFailure as exc:
            if attempt < 2 and any(s in str(exc) for s in _PORT_IN_USE):
                continue
            raise
    raise AssertionError("unreachable")
