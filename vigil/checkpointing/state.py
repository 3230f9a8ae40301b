"""The named state of a rank and its layout: ``state_of`` / ``check_state``, the tree, its DCP keys.

**What is saved, and resharding.** Each rank's state is one tree: the step, the model's
``state_dict()``, the strategy's ``state_dict()``, the data position and the RNG states. The
strategy's :meth:`~vigil.optim.base.Strategy.state_layout` says which parts are replicated,
flat-sharded, per-rank local or "current" (see :mod:`vigil.optim.base`); the RNG is local, the
step and the data position are replicated, the model is replicated unless the layout says it is
local. Tensors are stored under DCP keys by part, because DCP keeps one copy of a plain tensor that
several ranks save under the same key:

* ``rep/<path>``: replicated (every rank writes it, DCP keeps one);
* ``rank<r>/<path>``: rank ``r``'s local tensors;
* ``shard<r>/<path>``: rank ``r``'s shard of a flat-sharded tensor;
* ``meta/rank<r>``: rank ``r``'s tree with every tensor replaced by a reference, as JSON in a uint8
  tensor (so the structure and the plain values need no pickle).

Restoring such a tree (on any world size): :mod:`vigil.checkpointing.reshard`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from vigil.checkpointing.format import FORMAT_VERSION
from vigil.optim.base import Shard, StateLayout, StatePath

# Top-level keys of a rank's state tree (named constants: CONVENTIONS 6).
KEY_STEP = "step"
KEY_MODEL = "model"
KEY_STRATEGY = "strategy"
KEY_DATA = "data"
KEY_RNG = "rng"
KEY_RNG_TORCH = "torch"
KEY_RNG_PYTHON = "python"

# DCP key prefixes.
_REP = "rep"
_META = "meta"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------------------------------
# State trees: flatten to DCP keys (with a JSON skeleton)
# --------------------------------------------------------------------------------------------------


def _seg(p: str | int) -> str:
    if isinstance(p, bool) or not isinstance(p, int | str):
        raise TypeError(f"state dict keys must be str or int, got {type(p).__name__}: {p!r}")
    if isinstance(p, int):
        return f"#{p}"
    return p.replace("%", "%25").replace("/", "%2F").replace("#", "%23") or "%"


def _path_str(path: StatePath) -> str:
    return "/".join(_seg(p) for p in path)


RESERVED_KEYS = frozenset({KEY_STEP, KEY_RNG})
"""Names a caller's state objects may not take: the tree's own entries."""
_STATE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def state_of(model: nn.Module | None = None, strategy: Stateful | None = None,
             data: Stateful | None = None) -> dict[str, Stateful]:
    """The classic trio as a state mapping (``model``, ``strategy``, ``data``), leaving out what is None."""
    return {k: v for k, v in ((KEY_MODEL, model), (KEY_STRATEGY, strategy), (KEY_DATA, data)) if v is not None}


def check_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as a dict, its names and objects checked (``ValueError`` naming the offending one)."""
    if not state:
        raise ValueError("checkpoint state: hand in at least one object (model=..., optimizer=..., ...)")
    for name, obj in state.items():
        if not isinstance(name, str) or not _STATE_NAME.match(name) or name in RESERVED_KEYS:
            raise ValueError(f"checkpoint state: name {name!r} must be an identifier of at most 64 characters, "
                             f"not one of {sorted(RESERVED_KEYS)}")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"checkpoint state {name!r}: {type(obj).__name__} has no state_dict() / "
                             "load_state_dict() (wrap plain values in an object that has them)")
    return dict(state)


def _rank_tree(step: int, state: Mapping[str, Stateful]) -> dict[str, Any]:
    tree: dict[str, Any] = {KEY_STEP: step}
    for name, obj in state.items():
        tree[name] = obj.state_dict()
    tree[KEY_RNG] = {KEY_RNG_TORCH: torch.get_rng_state(), KEY_RNG_PYTHON: random.getstate()}
    return tree


class _TreeLayout:
    """The part of every path of a rank's tree.

    An object with a ``state_layout()`` (an optimizer strategy) has its layout applied under its
    name; a module whose strategy says ``local_model`` is local; the RNG is local; the rest is
    replicated.
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.layouts: dict[str, StateLayout] = {
            name: obj.state_layout() for name, obj in state.items() if callable(getattr(obj, "state_layout", None))
        }
        local_modules = {id(getattr(state[name], "module", None)) for name, lay in self.layouts.items()
                         if lay.local_model}
        self.local_names = frozenset(name for name, obj in state.items()
                                     if isinstance(obj, nn.Module) and id(obj) in local_modules)

    def part(self, path: StatePath) -> str | Shard:
        head = path[0] if path else None
        if isinstance(head, str) and head in self.layouts:
            return self.layouts[head].part_of(path[1:])
        if head in self.local_names or head == KEY_RNG:
            return "local"
        return "replicated"

    def padded(self, path: StatePath) -> int | None:
        head = path[0] if path else None
        return self.layouts[head].padded.get(path[1:]) if isinstance(head, str) and head in self.layouts else None

    def is_local_model(self, path: StatePath) -> bool:
        return bool(path) and path[0] in self.local_names

    def boundary(self, path: StatePath) -> str | None:
        """``"local"`` / ``"current"`` when ``path`` is exactly where such a rule starts."""
        if path == (KEY_RNG,) or (len(path) == 1 and path[0] in self.local_names):
            return "local"
        if path and isinstance(path[0], str) and path[0] in self.layouts:
            layout, rest = self.layouts[path[0]], path[1:]
            if rest in layout.current:
                return "current"
            if rest in layout.local:
                return "local"
        return None


def _encode(obj: Any, path: StatePath, on_tensor: Callable[[StatePath, torch.Tensor], dict[str, Any]]) -> Any:
    if isinstance(obj, torch.Tensor):
        return on_tensor(path, obj)
    if isinstance(obj, dict):
        return {"__d__": [[k if isinstance(k, str) else _as_int_key(k, path), _encode(v, (*path, k), on_tensor)]
                          for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"__l__": [_encode(v, (*path, i), on_tensor) for i, v in enumerate(obj)]}
    if isinstance(obj, tuple):
        return {"__tu__": [_encode(v, (*path, i), on_tensor) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint {type(obj).__name__} at {_path_str(path)!r}: keep state to tensors "
                    "and plain Python values")


def _as_int_key(k: Any, path: StatePath) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"state dict key {k!r} at {_path_str(path)!r} is neither str nor int")
    return k


def _save_state(step: int, rank: int, world_size: int, state: Mapping[str, Stateful]) -> dict[str, torch.Tensor]:
    """This rank's state as a flat ``{DCP key: tensor}``, including its JSON tree under ``meta/rank<r>``."""
    layout = _TreeLayout(state)
    flat: dict[str, torch.Tensor] = {}

    def on_tensor(path: StatePath, t: torch.Tensor) -> dict[str, Any]:
        part = layout.part(path)
        p = _path_str(path)
        ref: dict[str, Any] = {"__t__": p, "dtype": str(t.dtype), "shape": list(t.shape)}
        if isinstance(part, Shard):
            if t.dim() != 1 or t.numel() != part.length:
                raise ValueError(f"sharded {p!r}: expected a 1-D tensor of {part.length}, got {tuple(t.shape)}")
            ref.update(part="shard", numel=part.numel, length=part.length)
            key = f"shard{rank}/{p}"
        elif part == "replicated":
            ref["part"] = "replicated"
            key = f"{_REP}/{p}"
        else:  # local, current: per rank
            ref["part"] = "local"
            key = f"rank{rank}/{p}"
        flat[key] = t.detach()
        return ref

    tree = _encode(_rank_tree(step, state), (), on_tensor)
    skeleton = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "step": step, "tree": tree}
    flat[f"{_META}/rank{rank}"] = torch.frombuffer(bytearray(json.dumps(skeleton).encode()), dtype=torch.uint8)
    return flat

