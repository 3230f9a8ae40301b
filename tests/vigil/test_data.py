"""The pydoc corpus and per-rank sampling: determinism, disjoint shards, Stateful round trip.

Needs only the local CPython install (its ``pydoc_data`` and stdlib sources); no network.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch

from vigil.contract.schemas import DataSpec
from vigil.data import (
    BatchSampler,
    build_pydoc_corpus,
    build_samplers,
    load_corpus,
    rank_shard,
    split_corpus,
)

SPEC = DataSpec(max_bytes=100_000, val_fraction=0.1, seed=3)


def test_corpus_is_deterministic_bytes_of_requested_size(corpus_cache: Path) -> None:
    a = load_corpus(SPEC, corpus_cache)
    assert a.dtype == torch.uint8 and a.ndim == 1 and len(a) == SPEC.max_bytes
    assert bytes(a.numpy()) == build_pydoc_corpus(SPEC.max_bytes)
    # Starts with the documentation text, then code: both are in there.
    text = bytes(a.numpy())
    assert b"def " in text and b"The " in text


def test_corpus_cache_file_written_once_and_reused(tmp_path: Path) -> None:
    first = load_corpus(SPEC, tmp_path)
    files = list((tmp_path / "corpus").iterdir())
    assert len(files) == 1 and files[0].stat().st_size == SPEC.max_bytes
    # Prove the second load reads the cache: tamper with it and see the tampered bytes come back.
    files[0].write_bytes(b"x" * SPEC.max_bytes)
    again = load_corpus(SPEC, tmp_path)
    assert bytes(again.numpy()) == b"x" * SPEC.max_bytes
    assert not torch.equal(first, again)
    assert not [p for p in (tmp_path / "corpus").iterdir() if p.suffix == ".tmp"]


def test_split_and_rank_shards_are_disjoint_and_cover_train(corpus_cache: Path) -> None:
    corpus = load_corpus(SPEC, corpus_cache)
    split = split_corpus(corpus, SPEC.val_fraction)
    assert len(split.val) == 10_000 and len(split.train) == 90_000
    world = 3
    shards = [rank_shard(split.train, r, world) for r in range(world)]
    # Views into one buffer: disjoint means non-overlapping storage ranges, in rank order.
    spans = [(s.storage_offset(), s.storage_offset() + len(s)) for s in shards]
    for (_, end), (start, _) in pairwise(spans):
        assert end <= start
    assert spans[-1][1] <= split.val.storage_offset()
    assert sum(len(s) for s in shards) == len(split.train)  # 90_000 divides by 3


def test_each_rank_samples_only_from_its_shard(corpus_cache: Path) -> None:
    # Mark every byte with its shard so samples tell where they came from.
    data = torch.arange(4).repeat_interleave(1000).to(torch.uint8)
    for rank in range(4):
        shard = rank_shard(data, rank, 4)
        s = BatchSampler(shard, batch_size=16, context=32, seed=0, rank=rank, world_size=4)
        for _ in range(5):
            x, y = s.next()
            assert set(x.unique().tolist()) == {rank} and set(y.unique().tolist()) == {rank}


def test_batches_are_deterministic_and_shifted_by_one(corpus_cache: Path) -> None:
    t1, v1 = build_samplers(SPEC, 4, 32, rank=1, world_size=2, cache_dir=corpus_cache)
    t2, _ = build_samplers(SPEC, 4, 32, rank=1, world_size=2, cache_dir=corpus_cache)
    for _ in range(3):
        (x1, y1), (x2, y2) = t1.next(), t2.next()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (4, 32) and x1.dtype == torch.long
        assert torch.equal(x1[:, 1:], y1[:, :-1])
    # Another rank and another seed draw other windows.
    t0, _ = build_samplers(SPEC, 4, 32, rank=0, world_size=2, cache_dir=corpus_cache)
    assert not torch.equal(t0.sample(0)[0], t1.sample(0)[0])
    other = SPEC.model_copy(update={"seed": 4})
    t1b, _ = build_samplers(other, 4, 32, rank=1, world_size=2, cache_dir=corpus_cache)
    assert not torch.equal(t1b.sample(0)[0], t1.sample(0)[0])
    # Validation batches are the same for every rank.
    assert torch.equal(v1.sample(0)[0], build_samplers(SPEC, 4, 32, 0, 2, corpus_cache)[1].sample(0)[0])


def test_state_dict_round_trip_gives_the_same_next_batch(corpus_cache: Path) -> None:
    a, _ = build_samplers(SPEC, 4, 32, rank=0, world_size=2, cache_dir=corpus_cache)
    for _ in range(7):
        a.next()
    state = a.state_dict()
    expected = a.next()
    b, _ = build_samplers(SPEC, 4, 32, rank=0, world_size=2, cache_dir=corpus_cache)
    assert not torch.equal(b.sample(b.index)[0], expected[0])  # a fresh sampler is elsewhere
    b.load_state_dict(state)
    got = b.next()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert b.state_dict() == a.state_dict()


def test_too_little_data_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        BatchSampler(torch.zeros(10, dtype=torch.uint8), batch_size=1, context=16, seed=0)
    with pytest.raises(ValueError, match="rank"):
        rank_shard(torch.zeros(10, dtype=torch.uint8), 2, 2)
