"""Helpers of the checkpoint tests of tests/vigil (on a local folder, resharded, on S3).

One process, a world of one:

* :data:`SPEC`: a one-layer GPT job; :func:`build_parts` builds its model, optimizer strategy and data
  sampler from a seed; :func:`train_steps` trains them ``n`` steps and returns the last loss;
* :class:`CheckpointSink`: keeps the checkpoint samples a :class:`vigil.checkpointing.Checkpointer` reports.

Any optimizer kind on the tiny MLP of :mod:`tests.vigil.optim.common`, in the ranks of ``run_ranks``:

* :data:`CUT`, :data:`AFTER`: the steps before the checkpoint and after it;
* :class:`Position`: a minimal data position; :func:`make_strategy`: a strategy of a kind; :func:`train`
  trains it; :func:`snapshot`: its state, layout and model, for the parent to compare;
* :func:`check_restored` (in the parent, on what the ranks returned): asserts that state restored on
  another world size is the saved state re-split by its layout (replicated, sharded, local; a rank new
  to the job keeps its fresh values).

Needs: CPU torch; gloo for the ranks (:func:`tests.vigil.optim.harness.run_ranks`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tests.vigil.optim.common import flat_params, make, tiny_mlp, train_step
from vigil.comm import Comm
from vigil.contract.schemas import CheckpointSample, JobCreate
from vigil.data import BatchSampler
from vigil.model import build_model
from vigil.optim import build_strategy
from vigil.optim.base import Shard, Strategy

SPEC = JobCreate(name="ckpt", model={"n_layer": 1, "n_head": 2, "d_model": 16, "context": 8})


class CheckpointSink:
    def __init__(self) -> None:
        self.samples: list[CheckpointSample] = []

    def send_checkpoint(self, sample: CheckpointSample) -> None:
        self.samples.append(sample)


def build_parts(seed: int) -> tuple[Any, Any, BatchSampler]:
    torch.manual_seed(seed)
    model = build_model(SPEC.model)
    strategy = build_strategy(SPEC.optimizer, model, Comm())
    data = BatchSampler(torch.arange(256, dtype=torch.uint8).repeat(4), 2, 8, seed=seed)
    return model, strategy, data


def train_steps(model: Any, strategy: Any, data: BatchSampler, n: int, first: int = 1) -> float:
    loss = math.nan
    for step in range(first, first + n):
        x, y = data.next()
        strategy.zero_grad()
        _, out = strategy.model(x, y)
        out.backward()
        strategy.step(step, 1e-2)
        loss = float(out.detach())
    return loss


CUT, AFTER = 4, 2
"""Train CUT steps (mid-period for tau = H = 3, after PowerSGD started compressing), checkpoint, then AFTER more."""


class Position:
    """A minimal data position (the loop's BatchSampler is Stateful the same way)."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def make_strategy(kind: str, params: dict[str, Any], seed: int = 0) -> Strategy:
    return make(kind, tiny_mlp(seed), weight_decay=0.05, grad_clip=1.0, **params)


def _flat(tree: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    out: dict[tuple[Any, ...], torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[path] = tree.detach().clone()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, (*path, k)))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(_flat(v, (*path, i)))
    return out


def snapshot(strategy: Strategy) -> dict[str, Any]:
    layout = strategy.state_layout()
    state = _flat(strategy.state_dict())
    return {
        "state": state,
        "parts": {p: layout.part_of(p) for p in state},
        "padded": dict(layout.padded),
        "local_model": layout.local_model,
        "model": flat_params(strategy.module),
    }


def train(strategy: Strategy, rank: int, first: int, n: int, pos: Position) -> list[float]:
    losses = []
    for t in range(first, first + n):
        losses.append(train_step(strategy, rank, t))
        pos.index += 1
    return losses


def check_restored(saved: list[dict[str, Any]], restored: list[dict[str, Any]], fresh: list[dict[str, Any]],
                    kind: str) -> None:
    old_world, new_world = len(saved), len(restored)
    parts = saved[0]["parts"]
    # The convention's promise: what a strategy calls replicated is identical on every rank.
    for p, part in parts.items():
        if part == "replicated":
            for s in saved[1:]:
                assert torch.equal(s["state"][p], saved[0]["state"][p]), (kind, "replicated differs", p)
    for p, part in parts.items():
        if isinstance(part, Shard):
            old = torch.cat([s["state"][p] for s in saved])
            new_shard = restored[0]["parts"][p]
            assert isinstance(new_shard, Shard) and new_shard.numel == part.numel
            new = torch.cat([r["state"][p] for r in restored])
            assert all(r["state"][p].numel() == new_shard.length for r in restored)
            n = part.numel
            assert torch.equal(new[:n], old[:n]), (kind, "re-split", p)
            assert not new[n:].any(), (kind, "padding", p)
            continue
        for rank, r in enumerate(restored):
            if part == "current":
                continue
            got = r["state"].get(p)
            length = r["padded"].get(p)
            if part == "local" and rank >= old_world:
                want = fresh[rank]["state"].get(p)  # a rank new to the job: its fresh value
                assert (got is None) == (want is None), (kind, p)
                if got is not None:
                    assert torch.equal(got, want), (kind, "fresh", p)
                continue
            want = saved[0 if part == "replicated" else rank]["state"][p]
            assert got is not None, (kind, "missing", p)
            if length is not None and want.numel() != length:  # a padded flat buffer: real prefix first
                k = min(length, want.numel())
                assert got.numel() == length and torch.equal(got[:k], want[:k]) and not got[k:].any(), (kind, p)
            else:
                assert torch.equal(got, want), (kind, part, p)
    # The model: replicated, or each rank's own (a new rank starts from the documented model).
    for rank, r in enumerate(restored):
        if not saved[0]["local_model"]:
            assert torch.equal(r["model"], saved[0]["model"]), (kind, rank)
        elif rank < old_world:
            assert torch.equal(r["model"], saved[rank]["model"]), (kind, rank)
        else:
            state = r["state"]
            if ("x_hat",) in state:  # CSER, QSparse: the synchronised model
                assert torch.equal(r["model"], state[("x_hat",)]), (kind, rank)
            elif state.get(("x_old",)) is not None:  # SlowMo, DSM: the last synchronised model
                x_old = torch.cat([q["state"][("x_old",)] for q in restored]) if isinstance(
                    r["parts"][("x_old",)], Shard) else state[("x_old",)]
                assert torch.equal(r["model"], x_old[: r["model"].numel()].to(r["model"].dtype)), (kind, rank)
            else:  # Local AdamW: a peer's model
                assert torch.equal(r["model"], saved[rank % old_world]["model"]), (kind, rank)
    assert new_world != old_world
