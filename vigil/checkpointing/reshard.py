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

import functools
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
    metadata = dcp_reader(directory).read_metadata()
    old_world = _old_world_size(directory, metadata, manifest)
    src = rank if rank < old_world else None
    skeleton = _read_skeleton(directory, metadata, src if src is not None else 0)
    _keep_only(directory, skeleton, named)
    rebuild = _Rebuild(directory, named, rank=rank, world_size=world_size, old_world=old_world, src=src)
    step = _load_tree(named, rebuild.tree(skeleton["tree"], metadata))
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


def _old_world_size(directory: Location, metadata: Any, manifest: Manifest) -> int:
    """The world size the checkpoint was taken on: its rank trees, which must agree with its manifest."""
    old_world = sum(1 for k in metadata.state_dict_metadata if k.startswith(f"{_META}/rank"))
    if old_world != manifest.world_size:
        raise InvalidCheckpoint(f"{directory}: {old_world} rank trees, the manifest says {manifest.world_size} ranks")
    return old_world


def _read_skeleton(directory: Location, metadata: Any, template_rank: int) -> dict[str, Any]:
    """Old rank ``template_rank``'s tree as saved: its structure, tensors as references to DCP keys."""
    key = f"{_META}/rank{template_rank}"
    raw = _read(directory, metadata, [key])[key]
    skeleton = json.loads(bytes(raw.numpy()).decode())
    if skeleton.get("format") != FORMAT_VERSION:
        raise InvalidCheckpoint(f"{directory}: rank tree format {skeleton.get('format')!r}")
    return skeleton


def _keep_only(directory: Location, skeleton: dict[str, Any], named: Mapping[str, Stateful]) -> None:
    """Cut the skeleton's top level down to the names asked for (and the reserved ones); ValueError when
    one asked for was never saved."""
    saved_names = {k for k, _ in skeleton["tree"].get("__d__", [])} - RESERVED_KEYS
    missing = sorted(set(named) - saved_names)
    if missing:
        raise ValueError(f"{directory}: the checkpoint holds no state named {missing} (it holds {sorted(saved_names)})")
    skeleton["tree"]["__d__"] = [[k, v] for k, v in skeleton["tree"]["__d__"] if k in named or k in RESERVED_KEYS]


class _Rebuild:
    """This rank's state tree rebuilt from a checkpoint's skeleton (module docstring): which subtrees are
    taken from the fresh state, and which saved tensors each tensor is read (pass 1) and built from (pass 2)."""

    def __init__(self, directory: Location, named: Mapping[str, Stateful], *, rank: int, world_size: int,
                 old_world: int, src: int | None) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.old_world = old_world
        self.src = src
        """The old rank whose local state this rank takes; None when there is none (a new rank)."""
        self.template_rank = src if src is not None else 0
        self.model_src = src if src is not None else rank % old_world
        self.layout = _TreeLayout(named)
        self.fresh = _rank_tree(0, named)
        self.refs: list[_Ref] = []

    def tree(self, skeleton_tree: Any, metadata: Any) -> Any:
        """The rebuilt tree: the skeleton decoded, then every tensor it needs read at once and built."""
        tree = _decode(skeleton_tree, (), self.leaf, self.substitute)
        got = _read(self.directory, metadata, [k for r in self.refs for k in r.keys])
        return _resolve_refs(tree, got)

    def substitute(self, path: StatePath) -> Any:
        kind = self.layout.boundary(path)
        if kind == "current" or (kind == "local" and self.src is None and not self.layout.is_local_model(path)):
            return _lookup(self.fresh, path)
        return _KEEP

    def leaf(self, path: StatePath, ref: dict[str, Any]) -> _Ref:
        p = ref["__t__"]
        length = self.layout.padded(path)
        part = ref.get("part")
        if part in ("replicated", "local"):
            r = self._whole(path, p, part, length)
        elif part == "shard":
            r = self._shard(path, p, ref)
        else:
            raise InvalidCheckpoint(f"{self.directory}: unknown part {part!r} at {p!r}")
        self.refs.append(r)
        return r

    def _whole(self, path: StatePath, p: str, part: str, length: int | None) -> _Ref:
        """A replicated tensor, or a local one (from the old rank this rank takes it from)."""
        owner = self.model_src if self.layout.is_local_model(path) and self.src is None else self.template_rank
        key = f"{_REP}/{p}" if part == "replicated" else f"rank{owner}/{p}"
        return _Ref(functools.partial(_whole_tensor, key=key, length=length), [key])

    def _shard(self, path: StatePath, p: str, ref: dict[str, Any]) -> _Ref:
        """This rank's shard, from the old shards that overlap its new slice."""
        new = self.layout.part(path)
        if not isinstance(new, Shard):
            raise InvalidCheckpoint(f"{self.directory}: {p!r} was sharded; this strategy does not shard it")
        numel, old_len = int(ref["numel"]), int(ref["length"])
        if new.numel != numel:
            raise InvalidCheckpoint(f"{self.directory}: {p!r} shards {numel} elements, this model has {new.numel}")
        lo = self.rank * new.length
        # Same layout: the slice verbatim, padding included (a strategy may keep rounding noise
        # there, and exactness needs it). Another layout: the real elements, zero padding.
        same = self.old_world == self.world_size and old_len == new.length
        hi = (self.rank + 1) * new.length if same else min((self.rank + 1) * new.length, numel)
        owners = list(range(lo // old_len, -(-hi // old_len))) if hi > lo and old_len > 0 else []
        keys = [f"shard{j}/{p}" for j in owners]
        dtype = getattr(torch, ref["dtype"].removeprefix("torch."))
        build = functools.partial(_shard_tensor, lo=lo, hi=hi, owners=owners, keys=keys, length=new.length,
                                  old_len=old_len, dtype=dtype)
        return _Ref(build, keys)


def _whole_tensor(got: dict[str, torch.Tensor], *, key: str, length: int | None) -> torch.Tensor:
    return _resized(got[key], length)


def _shard_tensor(got: dict[str, torch.Tensor], *, lo: int, hi: int, owners: list[int], keys: list[str],
                  length: int, old_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the whole flat tensor, from the old shards ``owners`` (``keys``) of ``old_len``
    each, zero-padded to ``length``."""
    out = torch.zeros(length, dtype=dtype)
    for j, key in zip(owners, keys, strict=True):
        a, b = max(lo, j * old_len), min(hi, (j + 1) * old_len)
        out[a - lo : b - lo] = got[key][a - j * old_len : b - j * old_len]
    return out


def _resolve_refs(node: Any, got: dict[str, torch.Tensor]) -> Any:
    """``node`` with every :class:`_Ref` in it built from the tensors read (``got``)."""
    if isinstance(node, _Ref):
        return node.build(got)
    if isinstance(node, dict):
        return {k: _resolve_refs(v, got) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve_refs(v, got) for v in node]
    if isinstance(node, tuple):
        return tuple(_resolve_refs(v, got) for v in node)
    return node


def _load_tree(named: Mapping[str, Stateful], tree: dict[str, Any]) -> int:
    """Load each named object's state and the RNGs from the rebuilt tree; returns its step."""
    for name, obj in named.items():
        obj.load_state_dict(tree[name])
    torch.set_rng_state(tree[KEY_RNG][KEY_RNG_TORCH])
    random.setstate(_as_python_rng_state(tree[KEY_RNG][KEY_RNG_PYTHON]))
    return int(tree[KEY_STEP])


def _as_python_rng_state(s: Any) -> tuple[Any, ...]:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)
