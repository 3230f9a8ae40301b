"""Save and restore one checkpoint folder; a restore reshards onto the current world size.

:func:`save` writes every rank's flattened tree (:mod:`vigil.checkpointing.state`) with DCP and has
rank 0 write the manifest (:mod:`vigil.checkpointing.format`). :func:`restore` reads it back, on any world size.

A restore on N' ranks from a checkpoint of N ranks: new rank ``r`` reads the tree of old rank
``r`` (old rank 0's when ``r >= N``), loads replicated tensors as they are, its own local ones from
old rank ``r`` (fresh values when there is none), and rebuilds each shard from the old shards that
overlap its new slice (reading only those). On the same world size every rank gets back exactly
what it saved.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vigil.checkpointing.format import (
    FORMAT_VERSION,
    InvalidCheckpoint,
    Manifest,
    resolve,
    verify,
    write_manifest,
)
from vigil.checkpointing.state import (
    _META,
    _REP,
    KEY_RNG,
    KEY_RNG_PYTHON,
    KEY_RNG_TORCH,
    KEY_STEP,
    RESERVED_KEYS,
    Stateful,
    _path_str,
    _rank_tree,
    _save_state,
    _TreeLayout,
    check_state,
    state_of,
)
from vigil.checkpointing.storage import Location, as_location, dcp_reader, dcp_writer
from vigil.optim.base import Shard, StatePath, Strategy

log = logging.getLogger(__name__)

# DCP warns on every single-process save or load, also from the async writer's thread: a world of
# one process is meant here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


# --------------------------------------------------------------------------------------------------
# State trees back from DCP keys
# --------------------------------------------------------------------------------------------------


class _Ref:
    """A tensor the restore still has to read (pass 1), then build (pass 2)."""

    def __init__(self, build: Callable[[dict[str, torch.Tensor]], torch.Tensor], keys: list[str]) -> None:
        self.build = build
        self.keys = keys


_DROP = object()
"""A key that the restored tree leaves out (absent from the fresh state it was to be taken from)."""
_KEEP = object()
"""``substitute``'s answer when the saved subtree is to be decoded (no substitution)."""


def _decode(node: Any, path: StatePath, leaf: Callable[[StatePath, dict[str, Any]], Any],
            substitute: Callable[[StatePath], Any]) -> Any:
    sub = substitute(path)
    if sub is not _KEEP:
        return sub
    if isinstance(node, dict):
        if "__t__" in node:
            return leaf(path, node)
        if "__d__" in node:
            out = {}
            for k, v in node["__d__"]:
                val = _decode(v, (*path, k), leaf, substitute)
                if val is not _DROP:
                    out[k] = val
            return out
        if "__l__" in node:
            return [x for i, v in enumerate(node["__l__"]) if (x := _decode(v, (*path, i), leaf, substitute)) is not _DROP]
        if "__tu__" in node:
            return tuple(_decode(v, (*path, i), leaf, substitute) for i, v in enumerate(node["__tu__"]))
        raise InvalidCheckpoint(f"unknown node in checkpoint tree at {_path_str(path)!r}")
    return node


def _lookup(tree: Any, path: StatePath) -> Any:
    node = tree
    for p in path:
        found = (isinstance(node, dict) and p in node) or (
            isinstance(node, list | tuple) and isinstance(p, int) and 0 <= p < len(node)
        )
        if not found:
            return _DROP
        node = node[p]
    return node


def _resized(t: torch.Tensor, length: int | None) -> torch.Tensor:
    """A replicated/local 1-D flat buffer cut or zero-extended to ``length`` (real elements first)."""
    if length is None or t.dim() != 1 or t.numel() == length:
        return t
    out = torch.zeros(length, dtype=t.dtype)
    n = min(t.numel(), length)
    out[:n] = t[:n]
    return out


def _read(directory: Location, metadata: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors ``keys`` of the checkpoint, read by this rank alone (no collective)."""
    targets: dict[str, torch.Tensor] = {}
    for k in sorted(set(keys)):
        md = metadata.state_dict_metadata.get(k)
        if not isinstance(md, TensorStorageMetadata):
            raise InvalidCheckpoint(f"{directory}: no tensor {k!r} in the checkpoint")
        targets[k] = torch.empty(md.size, dtype=md.properties.dtype)
    if targets:
        dcp.load(targets, storage_reader=dcp_reader(directory), no_dist=True)
    return targets


# --------------------------------------------------------------------------------------------------
# Save and restore one checkpoint folder
# --------------------------------------------------------------------------------------------------


def save(
    directory: Location, *, step: int, rank: int, world_size: int, state: Mapping[str, Stateful] | None = None,
    model: nn.Module | None = None, strategy: Strategy | None = None, data: Stateful | None = None,
    group: Any = None, loss: float | None = None, job_id: str = "",
) -> Manifest | None:
    """Save every rank's state after ``step`` into ``directory`` (a folder or a URI), synchronously;
    collective over ``group``.

    ``state``: named objects with ``state_dict()`` (``model``, ``strategy``, ``data`` are shorthands
    for those names). Rank 0 then writes the manifest and returns it (other ranks return None). Does
    not check the loss (see :meth:`Checkpointer.save`).
    """
    directory = as_location(directory)
    named = check_state({**state_of(model, strategy, data), **(state or {})})
    flat = _save_state(step, rank, world_size, named)
    dcp.save(flat, storage_writer=dcp_writer(directory), process_group=group)
    if rank == 0:
        return write_manifest(directory, step=step, world_size=world_size, loss=loss, job_id=job_id)
    return None


def restore(
    directory: Location, *, rank: int, world_size: int, state: Mapping[str, Stateful] | None = None,
    model: nn.Module | None = None, strategy: Strategy | None = None, data: Stateful | None = None,
    verify_checksums: bool = True,
) -> int:
    """Load this rank's state from the checkpoint ``directory`` in place; returns its step.

    ``state``: the same names as saved (``model``, ``strategy``, ``data`` are shorthands). Any world
    size: see the module docstring. On a world size other than the checkpoint's, every rank must
    call this (``after_restore`` of a strategy may communicate). Raises :class:`InvalidCheckpoint`
    when the folder does not verify, ``ValueError`` when it lacks a name asked for.
    """
    named = check_state({**state_of(model, strategy, data), **(state or {})})
    directory = resolve(directory)
    manifest = verify(directory, checksums=verify_checksums)
    reader = dcp_reader(directory)
    metadata = reader.read_metadata()
    old_world = sum(1 for k in metadata.state_dict_metadata if k.startswith(f"{_META}/rank"))
    if old_world != manifest.world_size:
        raise InvalidCheckpoint(f"{directory}: {old_world} rank trees, the manifest says {manifest.world_size} ranks")
    src = rank if rank < old_world else None
    template_rank = src if src is not None else 0
    raw = _read(directory, metadata, [f"{_META}/rank{template_rank}"])[f"{_META}/rank{template_rank}"]
    skeleton = json.loads(bytes(raw.numpy()).decode())
    if skeleton.get("format") != FORMAT_VERSION:
        raise InvalidCheckpoint(f"{directory}: rank tree format {skeleton.get('format')!r}")

    saved_names = {k for k, _ in skeleton["tree"].get("__d__", [])} - RESERVED_KEYS
    missing = sorted(set(named) - saved_names)
    if missing:
        raise ValueError(f"{directory}: the checkpoint holds no state named {missing} (it holds {sorted(saved_names)})")
    skeleton["tree"]["__d__"] = [[k, v] for k, v in skeleton["tree"]["__d__"] if k in named or k in RESERVED_KEYS]
    layout = _TreeLayout(named)
    fresh = _rank_tree(0, named)
    model_src = src if src is not None else rank % old_world
    refs: list[_Ref] = []

    def substitute(path: StatePath) -> Any:
        kind = layout.boundary(path)
        if kind == "current" or (kind == "local" and src is None and not layout.is_local_model(path)):
            return _lookup(fresh, path)
        return _KEEP

    def leaf(path: StatePath, ref: dict[str, Any]) -> Any:
        p = ref["__t__"]
        length = layout.padded(path)
        part = ref.get("part")
        if part in ("replicated", "local"):
            owner = model_src if layout.is_local_model(path) and src is None else template_rank
            key = f"{_REP}/{p}" if part == "replicated" else f"rank{owner}/{p}"

            def whole(got: dict[str, torch.Tensor], key: str = key, length: int | None = length) -> torch.Tensor:
                return _resized(got[key], length)

            r = _Ref(whole, [key])
        elif part == "shard":
            new = layout.part(path)
            if not isinstance(new, Shard):
                raise InvalidCheckpoint(f"{directory}: {p!r} was sharded; this strategy does not shard it")
            numel, old_len = int(ref["numel"]), int(ref["length"])
            if new.numel != numel:
                raise InvalidCheckpoint(f"{directory}: {p!r} shards {numel} elements, this model has {new.numel}")
            lo = rank * new.length
            # Same layout: the slice verbatim, padding included (a strategy may keep rounding noise
            # there, and exactness needs it). Another layout: the real elements, zero padding.
            same = old_world == world_size and old_len == new.length
            hi = (rank + 1) * new.length if same else min((rank + 1) * new.length, numel)
            owners = list(range(lo // old_len, -(-hi // old_len))) if hi > lo and old_len > 0 else []
            keys = [f"shard{j}/{p}" for j in owners]
            dtype = getattr(torch, ref["dtype"].removeprefix("torch."))

            def build(got: dict[str, torch.Tensor], lo: int = lo, hi: int = hi, owners: list[int] = owners,
                      keys: list[str] = keys, length: int = new.length, old_len: int = old_len,
                      dtype: torch.dtype = dtype) -> torch.Tensor:
                out = torch.zeros(length, dtype=dtype)
                for j, key in zip(owners, keys, strict=True):
                    a, b = max(lo, j * old_len), min(hi, (j + 1) * old_len)
                    out[a - lo : b - lo] = got[key][a - j * old_len : b - j * old_len]
                return out

            r = _Ref(build, keys)
        else:
            raise InvalidCheckpoint(f"{directory}: unknown part {part!r} at {p!r}")
        refs.append(r)
        return r

    tree = _decode(skeleton["tree"], (), leaf, substitute)
    got = _read(directory, metadata, [k for r in refs for k in r.keys])

    def resolve_refs(node: Any) -> Any:
        if isinstance(node, _Ref):
            return node.build(got)
        if isinstance(node, dict):
            return {k: resolve_refs(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve_refs(v) for v in node]
        if isinstance(node, tuple):
            return tuple(resolve_refs(v) for v in node)
        return node

    tree = resolve_refs(tree)
    for name, obj in named.items():
        obj.load_state_dict(tree[name])
    torch.set_rng_state(tree[KEY_RNG][KEY_RNG_TORCH])
    random.setstate(_as_python_rng_state(tree[KEY_RNG][KEY_RNG_PYTHON]))
    step = int(tree[KEY_STEP])
    if old_world != world_size:
        for obj in named.values():
            after = getattr(obj, "after_restore", None)
            if callable(after) and callable(getattr(obj, "state_layout", None)):
                after(old_world_size=old_world, fresh=src is None)
        log.warning("rank %d: restored step %d from %s, taken on %d ranks, now %d (%s)", rank, step, directory,
                    old_world, world_size, "fresh local state" if src is None else f"old rank {src}'s local state")
    else:
        log.info("rank %d restored step %d from %s", rank, step, directory)
    return step


def _as_python_rng_state(s: Any) -> tuple[Any, ...]:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
