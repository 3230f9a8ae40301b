"""Disk spool: numbering persisted across restarts, order, byte bound with oldest-first drop.

Needs: a writable temporary folder.
"""

from __future__ import annotations

import pytest

from agent.spool import STATE_FILE, Spool, SpoolLockedError, batch_file_name


def test_numbering_continues_after_reopen(tmp_path):
    with Spool(tmp_path) as s:
        assert [s.allocate_seq() for _ in range(3)] == [0, 1, 2]
    with Spool(tmp_path) as s:
        assert s.allocate_seq() == 3
        assert (tmp_path / STATE_FILE).read_text().strip() == "4"  # written before 3 was handed out


def test_numbering_never_goes_below_spooled_batches(tmp_path):
    with Spool(tmp_path) as s:
        for _ in range(5):
            seq = s.allocate_seq()
            s.put(seq, b"x" * 10, samples=1)
    (tmp_path / STATE_FILE).unlink()  # state lost: the spooled files still set the floor
    with Spool(tmp_path) as s:
        assert s.allocate_seq() == 5


def test_unreadable_state_continues_above_anything_used(tmp_path):
    with Spool(tmp_path) as s:
        for _ in range(3):
            s.allocate_seq()
    (tmp_path / STATE_FILE).write_text("garbage")
    with Spool(tmp_path) as s:
        assert s.allocate_seq() > 1_000_000_000_000  # ms since the epoch: above any count used


def test_one_agent_per_spool(tmp_path):
    first = Spool(tmp_path)
    with pytest.raises(SpoolLockedError):
        Spool(tmp_path)
    first.close()
    Spool(tmp_path).close()


def test_batches_come_back_in_seq_order_after_reopen(tmp_path):
    with Spool(tmp_path) as s:
        for seq in (7, 3, 5):
            s.put(seq, f"body-{seq}".encode(), samples=seq)
        assert [b.seq for b in s.batches()] == [3, 5, 7]
    with Spool(tmp_path) as s:
        assert [(b.seq, b.samples, b.read()) for b in s.batches()] == [
            (3, 3, b"body-3"),
            (5, 5, b"body-5"),
            (7, 7, b"body-7"),
        ]
        assert s.oldest().seq == 3
        s.remove(3)
        assert s.oldest().seq == 5 and len(s) == 2 and s.samples == 12
        assert sorted(p.name for p in tmp_path.glob("*.json.gz")) == [
            batch_file_name(5, 5),
            batch_file_name(7, 7),
        ]


def test_writes_are_atomic_and_leftover_temp_files_are_cleaned(tmp_path):
    (tmp_path / ".tmp-00000000000000000009-4.json.gz").write_bytes(b"half a batch")  # crash mid-write
    with Spool(tmp_path) as s:
        assert len(s) == 0  # the torn write is not taken for a batch
        s.put(s.allocate_seq(), b"whole", samples=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == []


def test_full_spool_drops_oldest_first_and_counts_lost_samples(tmp_path):
    with Spool(tmp_path, max_bytes=1000) as s:
        assert s.put(0, b"a" * 300, samples=10) == 0
        assert s.put(1, b"b" * 300, samples=20) == 0
        assert s.put(2, b"c" * 300, samples=30) == 0
        assert s.put(3, b"d" * 300, samples=40) == 10  # 1200 > 1000: batch 0 goes
        assert [b.seq for b in s.batches()] == [1, 2, 3] and s.size_bytes == 900
        assert s.put(4, b"e" * 650, samples=50) == 20 + 30  # needs two to go: 1 and 2
        assert [b.seq for b in s.batches()] == [3, 4] and s.size_bytes == 950
        assert s.dropped_batches == 3 and s.dropped_samples == 60
        assert sorted(p.name for p in tmp_path.glob("*.json.gz")) == [
            batch_file_name(3, 40),
            batch_file_name(4, 50),
        ]


def test_batch_larger_than_the_spool_is_dropped_itself(tmp_path):
    with Spool(tmp_path, max_bytes=100) as s:
        s.put(0, b"a" * 50, samples=1)
        assert s.put(1, b"b" * 101, samples=7) == 7
        assert [b.seq for b in s.batches()] == [0]  # the older, smaller batch is kept
        assert s.dropped_samples == 7
