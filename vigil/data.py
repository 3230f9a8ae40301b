"""Training data: the offline "pydoc" corpus, its train/val split, and per-rank batch sampling.

The corpus exists on every machine with a CPython install, so nothing is downloaded: the English
documentation text of ``pydoc_data.topics`` (sorted by topic name) followed by the standard
library's ``.py`` sources (walked in sorted path order), cut at ``max_bytes``. The same Python
version gives the same bytes everywhere.

The bytes are cached in one file per (Python version, max_bytes) under the cache dir, written
atomically (temp file + ``os.replace``), so ranks starting together never read a half-written file
and do not each walk the stdlib.

Split: the last ``val_fraction`` of the corpus is validation, the rest is training. Each rank
samples only from its own contiguous, disjoint shard of the training part. Batch ``i`` of a rank
is drawn with a ``torch.Generator`` seeded from ``(seed, rank, i)``, so the data position is one
integer: :class:`BatchSampler` is Stateful with a tiny ``state_dict``, and a restore gives exactly
the next batch the run would have drawn.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vigil.contract.schemas import DataSpec
from vigil.contract.settings import ENV_HOME

log = logging.getLogger(__name__)

CORPUS_FORMAT = 1
"""Bump when the way the corpus is assembled changes, so stale caches are not reused."""

# State-dict keys of BatchSampler (named constants: CONVENTIONS 6).
KEY_SEED = "seed"
KEY_RANK = "rank"
KEY_WORLD_SIZE = "world_size"
KEY_INDEX = "index"

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def default_cache_dir() -> Path:
    """``$VIGIL_CACHE_DIR``, else ``$VIGIL_HOME/cache``, else ``~/.cache/vigil``."""
    if d := os.environ.get("VIGIL_CACHE_DIR"):
        return Path(d)
    if h := os.environ.get(ENV_HOME):
        return Path(h) / "cache"
    return Path.home() / ".cache" / "vigil"


def _iter_pydoc_sources() -> Iterator[bytes]:
    """The corpus pieces in their fixed order: doc topics, then stdlib sources by path."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name].encode("utf-8")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        # Sorting in place fixes os.walk's traversal order, which is otherwise filesystem order.
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(".py"):
                try:
                    yield (Path(root) / f).read_bytes()
                except OSError:  # unreadable file: skip it, the corpus is still deterministic per machine
                    continue


def build_pydoc_corpus(max_bytes: int) -> bytes:
    """Assemble the first ``max_bytes`` bytes of the corpus (no cache)."""
    parts: list[bytes] = []
    total = 0
    for piece in _iter_pydoc_sources():
        parts.append(piece)
        total += len(piece)
        if total >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_corpus(spec: DataSpec, cache_dir: Path | None = None) -> torch.Tensor:
    """The corpus of ``spec`` as a 1-D uint8 tensor, from the cache when present."""
    if spec.corpus != "pydoc":  # the schema allows only pydoc today; fail loudly if that changes
        raise ValueError(f"data.corpus: unknown corpus {spec.corpus!r}")
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    py = f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    path = cache_dir / "corpus" / f"pydoc-v{CORPUS_FORMAT}-py{py}-{spec.max_bytes}.bin"
    data: bytes | None = None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("corpus cache %s unreadable (%s); rebuilding", path, e)
    if data is None:
        data = build_pydoc_corpus(spec.max_bytes)
        try:
            _atomic_write(path, data)
        except OSError as e:  # a read-only home must not stop training; it only costs a rebuild
            log.warning("cannot cache corpus at %s: %s", path, e)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class Split:
    """The training and validation parts of a corpus."""

    train: torch.Tensor
    val: torch.Tensor


def split_corpus(corpus: torch.Tensor, val_fraction: float) -> Split:
    """The last ``val_fraction`` of the bytes is validation; contiguous, so no sequence straddles both."""
    n_val = int(len(corpus) * val_fraction)
    if n_val < 1 or n_val >= len(corpus):
        raise ValueError(f"val_fraction {val_fraction} leaves no train or no validation data in {len(corpus)} bytes")
    return Split(train=corpus[: len(corpus) - n_val], val=corpus[len(corpus) - n_val :])


def rank_shard(train: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous, disjoint slice of the training bytes (remainder bytes unused)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    size = len(train) // world_size
    return train[rank * size : (rank + 1) * size]


def _batch_seed(seed: int, rank: int, index: int) -> int:
    # A hash, not seed + rank + index, so neighbouring (rank, index) pairs do not share streams.
    digest = hashlib.blake2b(f"{seed}:{rank}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class BatchSampler:
    """Random windows of ``context + 1`` bytes from one array; ``next()`` gives ``(x, y)``, y shifted by one.

    Stateful: ``state_dict()`` holds the seed, the rank and the number of batches drawn.
    """

    def __init__(
        self, data: torch.Tensor, batch_size: int, context: int, *, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if len(data) < context + 2:
            raise ValueError(
                f"{len(data)} bytes of data are too few for context {context}: raise data.max_bytes or use fewer ranks"
            )
        self.data = data
        self.batch_size = batch_size
        self.context = context
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.index = 0

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``index`` (a pure function of seed, rank and index)."""
        g = torch.Generator().manual_seed(_batch_seed(self.seed, self.rank, index))
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.batch_size,), generator=g)
        offsets = torch.arange(self.context + 1)
        windows = self.data[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1], windows[:, 1:]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.sample(self.index)
        self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {KEY_SEED: self.seed, KEY_RANK: self.rank, KEY_WORLD_SIZE: self.world_size, KEY_INDEX: self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream ``state`` was drawing: its seed and index. The rank stays this
        sampler's own, so after a world-size change each rank draws from its new shard (and never
        replays an already used (seed, rank, index) batch)."""
        if state[KEY_SEED] != self.seed:
            log.info("data seed %s taken from the checkpoint (was %s)", state[KEY_SEED], self.seed)
        self.seed = int(state[KEY_SEED])
        self.index = int(state[KEY_INDEX])


def build_samplers(
    spec: DataSpec, batch_size: int, context: int, rank: int, world_size: int, cache_dir: Path | None = None
) -> tuple[BatchSampler, BatchSampler]:
    """``(train sampler over this rank's shard, validation sampler over the shared val split)``.

    The validation sampler uses rank 0's stream whatever the caller's rank, so every rank (and
    every method compared in a benchmark) evaluates on the same batches.
    """
    split = split_corpus(load_corpus(spec, cache_dir), spec.val_fraction)
    shard = rank_shard(split.train, rank, world_size)
    train = BatchSampler(shard, batch_size, context, seed=spec.seed, rank=rank, world_size=world_size)
    # Offset the seed so validation windows are not drawn from the same random stream as training.
    val = BatchSampler(split.val, batch_size, context, seed=spec.seed + 1_000_003, rank=0)
    return train, val
