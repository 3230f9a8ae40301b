"""The interface every optimizer strategy offers the train loop, and how its state is checkpointed.

State layout (what :mod:`vigil.checkpointing` needs to restore a strategy on another world size)
------------------------------------------------------------------------------------------------

``Strategy.state_dict()`` is a tree of dicts / lists / tuples whose leaves are tensors or plain
values (int, float, str, bool, None). :meth:`Strategy.state_layout` says, by *path* into that tree
(a tuple of keys and list indices; a rule covers everything below it, the longest matching path
wins), what each part is:

* **replicated** (the default): identical on every rank (AdamW moments of gradient-averaging
  methods, a globally synchronised model copy, generators drawn with a shared seed). Saved once
  (DCP keeps one copy of a key every rank writes); every new rank loads it.
* **sharded** (:class:`Shard`): a 1-D tensor that is this rank's equal slice of a flat buffer,
  rank ``r`` holding elements ``[r * length, (r + 1) * length)``; ``numel`` says how many of the
  buffer's elements are real (the rest is padding). Saved per shard; restored by concatenating
  the old shards and cutting the new rank's slice: on the same world size the slice comes back
  verbatim (padding included: a strategy may keep rounding noise there), on another one the real
  elements are re-split and the new padding is zero.
* **local** (:attr:`StateLayout.local`): this rank's own state (local optimizer moments,
  error-feedback residuals). New rank ``r`` takes old rank ``r``'s when the old world had such a
  rank; otherwise (the world grew) it keeps the *fresh* value its newly built strategy has (zeros,
  an empty optimizer state).
* **current** (:attr:`StateLayout.current`): describes the running configuration (world size,
  rank, layout descriptors); never restored, always the new strategy's own value.

A replicated or local flat buffer whose length depends on the world size (zero-padded to a
multiple of N) is named in :attr:`StateLayout.padded` with its length in the current world; its
real elements come first, so on another world size it is cut or zero-extended to that length.

``StateLayout.local_model`` says the model itself differs per rank (local steps, CSER's
``x_hat + e_i``): then rank ``r`` takes old rank ``r``'s weights, and a rank new to the job takes
old rank ``r mod N_old``'s, which :meth:`Strategy.after_restore` may replace (e.g. with the last
synchronised model). Gradient-averaging strategies keep the model replicated.

Why a fresh local part is sound, per family (the fresh rank's contribution to the next
synchronisation is "no unsynchronised progress yet", which every method below tolerates):

* error feedback (EF-SGD, CSER's ``e_i``, compressed AdamW's worker error, PowerSGD's error
  memory): the residual is the part of this rank's past updates not yet communicated. A new rank
  has communicated everything it did (nothing), so zero is its exact residual; a dropped rank's
  residual is lost, which costs at most one compression error, the same as one missed step of
  error feedback.
* local optimizer moments (Local AdamW / SlowMo / DSM inner AdamW, local momentum SGD): each
  rank's moments are an estimate from its own gradients; a fresh AdamW (bias correction from
  step 1) or a zero momentum is the method's own starting point for that estimate.
* local models (Local AdamW / SlowMo / DSM / QSparse / CSER): a new rank starts from a model the
  group already has (the last synchronised one where the strategy keeps it: DSM / SlowMo's x_old,
  QSparse / CSER's x_hat; else a peer's for Local AdamW), so the next average is still an average
  of valid worker models.
* a rank that leaves (the world shrank) takes its local state with it: its progress since the last
  synchronisation and its residual are dropped, as if its worker had skipped those local steps.
* sharded state (SDP4Bit's fp32 master and AdamW moments, DSM / SlowMo's x_old and m, compressed
  AdamW's owner error) has nothing fresh: it is re-split by flat index, every element keeps its
  value. Per-shard generators (DSM's randomized sign when sharded) are local: a new owner keeps
  its freshly seeded one, which only needs to be independent of the others.

Defaults (everything replicated, the model replicated) are right for DDP + AdamW.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

StatePath = tuple[str | int, ...]
"""A path into a state dict: keys of nested dicts, indices of nested lists."""


@dataclass(frozen=True)
class Shard:
    """A flat-sharded 1-D tensor: this rank holds ``[rank * length, (rank + 1) * length)`` of a
    buffer whose first ``numel`` elements are real (the rest is zero padding)."""

    numel: int
    """Real elements of the whole (concatenated) buffer."""
    length: int
    """Elements per shard in the current world (every rank's shard has this length)."""

    def __post_init__(self) -> None:
        if self.numel < 0 or self.length < 0:
            raise ValueError(f"shard numel and length must be >= 0, got {self.numel}, {self.length}")


@dataclass(frozen=True)
class StateLayout:
    """Which parts of a strategy's ``state_dict()`` are sharded, local or current (the rest is replicated)."""

    sharded: Mapping[StatePath, Shard] = field(default_factory=dict)
    """Flat-sharded 1-D tensors, by path."""
    local: tuple[StatePath, ...] = ()
    """Per-rank subtrees, by path."""
    current: tuple[StatePath, ...] = ()
    """Subtrees that describe the running configuration: never restored."""
    local_model: bool = False
    """The model's weights differ per rank (they are then saved per rank)."""
    padded: Mapping[StatePath, int] = field(default_factory=dict)
    """Replicated or local 1-D flat buffers padded for the world size: path -> length in the current world."""

    def part_of(self, path: StatePath) -> str | Shard:
        """``"replicated"``, ``"local"``, ``"current"`` or the :class:`Shard` of ``path`` (longest rule wins)."""
        best: tuple[int, str | Shard] = (-1, "replicated")
        for rule, shard in self.sharded.items():
            if path[: len(rule)] == rule and len(rule) > best[0]:
                best = (len(rule), shard)
        for kind, rules in (("local", self.local), ("current", self.current)):
            for rule in rules:
                if path[: len(rule)] == rule and len(rule) > best[0]:
                    best = (len(rule), kind)
        return best[1]

import torch
from torch import nn

from vigil.comm import Comm


class Strategy(ABC):
    """An optimizer together with the communication it needs.

    The loop calls ``strategy.model(x)`` for forward (the strategy may wrap the module, e.g. in
    DDP), ``loss.backward()``, then ``strategy.step(step, lr)``, which communicates and updates.
    """

    def __init__(self, model: nn.Module, comm: Comm) -> None:
        self.module = model
        self.comm = comm

    @property
    def model(self) -> nn.Module:
        """The module to run forward on."""
        return self.module

    @abstractmethod
    def step(self, step: int, lr: float) -> None:
        """Communicate and update parameters after ``backward()`` of step ``step`` at learning rate ``lr``."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (optimizer moments, error buffers, RNG, ...)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def eval_module(self) -> nn.Module:
        """The module whose parameters are the model to evaluate (the synchronised one)."""
        return self.module

    def state_layout(self) -> StateLayout:
        """How :meth:`state_dict` splits into replicated, sharded, local and current parts (module
        docstring). Default: everything replicated, which is right for DDP + AdamW."""
        return StateLayout()

    def reconfigure(self, params: Any) -> None:
        """Take new typed ``optimizer.params`` (:class:`vigil.contract.optimizer_params.OptimizerParams`) from
        the next step on, without a restart: what ``recovery.policy: adapt`` asks of the kinds it may change
        (``vigil.contract.schemas.ADAPTABLE``). Every rank calls it at the same step. Default: this strategy
        cannot change while it runs (``NotImplementedError`` naming it)."""
        raise NotImplementedError(f"{type(self).__name__} cannot change its optimizer.params while it runs")

    def after_restore(self, *, old_world_size: int, fresh: bool) -> None:
        """Called on every rank (in the same order, so it may communicate) after a checkpoint from
        ``old_world_size`` ranks was loaded on another world size. ``fresh``: this rank had no
        counterpart in the old world, so its local parts hold fresh values. Default: nothing."""


def clip_grad(model: nn.Module, max_norm: float) -> torch.Tensor | None:
    """Clip the global gradient norm when ``max_norm`` > 0."""
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return None
