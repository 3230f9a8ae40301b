"""What signing a live heal costs: Vigil's heal transport beside torchft's own, on one state, in one run.

``vigil bench heal [--json] [--mib 64] [--tensors 16] [--repeats 5]``

A heal moves one replica's whole state (weights, optimizer) from a live peer over HTTP. Two ways, in this
process, over loopback:

* ``torchft``: torchft 0.2.0's ``HTTPTransport`` (the baseline; what live recovery used before signing);
* ``signed``: :class:`vigil.live_trust.SignedHTTPTransport` (a signed request, the state serialised once,
  hashed, MAC-checked before it is unpickled).

Each heal is timed from the source's ``send_checkpoint`` to the end of the receiver's ``recv_checkpoint``
(what a replica waits for), on ``--tensors`` float32 tensors of ``--mib`` MiB in all. The ways alternate,
``--repeats`` times; each keeps its fastest (this machine is shared). Reported per way ``seconds`` (the fastest),
``seconds_all`` and ``mib_per_s``, and ``ratio``: signed's seconds over torchft's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from vigil.live_trust import SignedHTTPTransport, new_key

WAYS = ("torchft", "signed")
TIMEOUT = timedelta(seconds=120)


def make_state(mib: float, tensors: int) -> dict[str, Any]:
    """A state dict shaped like a heal's: ``{"user": {"model": {...}}, "torchft": {...}}``."""
    per = max(1, int(mib * 2**20 / 4 / tensors))
    return {"user": {"model": {f"w{i}": torch.randn(per) for i in range(tensors)}},
            "torchft": {"step": 7, "batches_committed": 14}}


def _pair(way: str) -> tuple[Any, Any]:
    if way == "torchft":
        from torchft.checkpointing.http_transport import HTTPTransport

        return HTTPTransport(TIMEOUT, num_chunks=0), HTTPTransport(TIMEOUT, num_chunks=0)
    key = new_key()
    return SignedHTTPTransport(key, "127.0.0.1", TIMEOUT), SignedHTTPTransport(key, "127.0.0.1", TIMEOUT)


def heal_once(way: str, state: dict[str, Any], step: int) -> float:
    """Seconds from the source's send to the receiver holding the state (checked equal)."""
    source, receiver = _pair(way)
    try:
        t0 = time.perf_counter()
        source.send_checkpoint([1], step, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, source.metadata(), step, TIMEOUT)
        seconds = time.perf_counter() - t0
        source.disallow_checkpoint()
    finally:
        source.shutdown(wait=False)
        receiver.shutdown(wait=False)
    want, have = state["user"]["model"], got["user"]["model"]
    if want.keys() != have.keys() or not all(torch.equal(want[k], have[k]) for k in want):
        raise RuntimeError(f"{way}: the healed state differs from the source's")
    return seconds


def summarize(runs: dict[str, list[float]], mib: float) -> dict[str, Any]:
    """Each way's fastest heal, its rate, and signed over torchft when both ran."""
    out: dict[str, Any] = {"transports": {w: {"seconds": round(min(s), 4), "seconds_all": [round(x, 4) for x in s],
                                              "mib_per_s": round(mib / min(s), 1)} for w, s in runs.items()}}
    if {"torchft", "signed"} <= runs.keys():
        out["ratio"] = round(min(runs["signed"]) / min(runs["torchft"]), 3)
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vigil bench heal", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    p.add_argument("--mib", type=float, default=64.0, help="Size of the state healed, in MiB.")
    p.add_argument("--tensors", type=int, default=16, help="Tensors the state is split in.")
    p.add_argument("--repeats", type=int, default=5, help="Heals of each way, alternating.")
    args = p.parse_args(argv)
    if args.mib <= 0:
        p.error(f"--mib: must be above 0, got {args.mib}")
    if args.tensors < 1 or args.repeats < 1:
        p.error("--tensors and --repeats: must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    state = make_state(args.mib, args.tensors)
    t0 = time.monotonic()
    runs: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.repeats):
        for w in WAYS:
            runs[w].append(heal_once(w, state, step=r + 1))
    out = {"state_mib": args.mib, "tensors": args.tensors, "repeats": args.repeats, **summarize(runs, args.mib),
           "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        print(json.dumps(out))
    else:
        for w, t in out["transports"].items():
            print(f"{w:>8}: {t['seconds']:.3f} s ({t['mib_per_s']} MiB/s)")
        print(f"signed / torchft: x{out['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
