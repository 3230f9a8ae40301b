"""The train loop's :class:`Checkpointer`: choice on start, async saves, manifest, retention, reports.

**Non-finite state is never written**: :meth:`Checkpointer.save` first agrees across ranks that
every rank's loss of the step and every parameter are finite; if not, nothing is written. That is
what makes a rollback after a NaN land on a good state.

**Asynchronous saves**: :meth:`Checkpointer.save` uses ``dcp.async_save`` (torch 2.13, gloo/CPU):
it copies ("stages") the state to fresh CPU memory on the calling thread and writes it from a
background thread, over a process group of its own (gloo), so training goes on and the training
group's collectives never interleave with the checkpoint's. Rank 0 writes the manifest when the
write completes; the loop polls for completion once per step. One save is in flight at a time. If
async saving fails to start, the save falls back to a synchronous ``dcp.save``.

A checkpoint is chosen on start among the root's folders and Ray Train's hint
(:func:`~vigil.checkpointing.format.choose`), flattened to DCP keys by :mod:`vigil.checkpointing.state`,
completed by a manifest and pruned by retention (:mod:`vigil.checkpointing.format`), and read back
by :func:`~vigil.checkpointing.reshard.restore`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from vigil.checkpointing.format import Manifest, choose, list_step_dirs, prune, remove_dir, write_manifest
from vigil.checkpointing.reshard import restore  # also silences DCP's single-process warning
from vigil.checkpointing.state import Stateful, _save_state, check_state
from vigil.checkpointing.storage import (
    Location,
    as_location,
    claim,
    dcp_writer,
    exists,
    join,
    list_dir,
    makedirs,
    name_of,
    same,
)
from vigil.contract.checkpoint_layout import attempts_dir, step_dir
from vigil.contract.schemas import CheckpointSample

log = logging.getLogger(__name__)


class CheckpointSink(Protocol):
    """Where rank 0's checkpoint samples go (the rank's telemetry)."""

    def send_checkpoint(self, sample: CheckpointSample) -> None: ...


@dataclass
class _Pending:
    step: int
    directory: Location
    future: concurrent.futures.Future[Any]
    loss: float | None


@dataclass
class Checkpointer:
    """Checkpoints of one rank session (:mod:`vigil.sdk`): every method is called by every rank at the same step.

    ``root``: a folder every rank sees, or a URI (``s3://bucket/prefix``: :mod:`vigil.checkpointing.storage`).
    None: a temporary local root for this call (rank 0 makes it, every rank uses it, :meth:`close`
    deletes it), with synchronous saves, so a checkpoint is complete at the report of its step.
    """

    root: Location | None
    rank: int
    world_size: int
    job_id: str
    keep_last: int = 3
    sink: CheckpointSink | None = None
    async_save: bool = True
    _group: Any = field(default=None, init=False, repr=False)
    _ctl: Any = field(default=None, init=False, repr=False)
    _temporary: bool = field(default=False, init=False)
    _pending: _Pending | None = field(default=None, init=False, repr=False)
    _finisher: concurrent.futures.ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _completed: Manifest | None = field(default=None, init=False, repr=False)
    _reported_step: int = field(default=-1, init=False)
    saved_steps: list[int] = field(default_factory=list, init=False)
    """Steps whose checkpoint this rank wrote (complete or in flight)."""
    skipped_steps: list[int] = field(default_factory=list, init=False)
    """Steps whose checkpoint was not written (non-finite loss or parameters)."""

    def __post_init__(self) -> None:
        self._distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        if self._distributed:
            # Groups of its own, both gloo (CPU tensors, whatever the training backend): one for the
            # async writer, whose collectives run on a background thread and must never interleave
            # with anyone else's, one for the small agreements of the main thread.
            self._group = dist.new_group(backend="gloo")
            self._ctl = dist.new_group(backend="gloo")
        if self.root is None:
            self._temporary = True
            self.async_save = False
            made = tempfile.mkdtemp(prefix="vigil-ckpt-") if self.rank == 0 else None
            self.root = Path(self._broadcast_object(made))
        self.root = as_location(self.root)
        if self.rank == 0:
            makedirs(self.root)
            if self.async_save:
                self._finisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="vigil-ckpt")

    # -- collectives -------------------------------------------------------------------------------

    def _broadcast_object(self, obj: Any) -> Any:
        if not self._distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._ctl)
        return box[0]

    def claim_attempt(self) -> int:
        """This start's run attempt: 1 + the highest claimed before it under :func:`attempts_dir` (rank 0
        makes its folder, atomically: two starts never get one number), the same on every rank.

        Telemetry tags every sample with it, so a step re-run after a restart is a new sample (the
        newest attempt wins), and a replay of an old one is recognised as the same sample. A
        temporary root (no job storage) claims there too: numbers start at 1 for each session.
        """
        number = 0
        if self.rank == 0:
            assert self.root is not None
            folder = attempts_dir(self.root)
            makedirs(folder)
            claimed = [int(e.name) for e in list_dir(folder) if e.name.isdigit()]
            number = max(claimed, default=0) + 1
            while not claim(join(folder, str(number))):
                number += 1  # another start claimed it in between: the next one
        return int(self._broadcast_object(number))

    def group_names(self) -> set[str]:
        """Names of the process groups this checkpointer made (its collectives are Vigil's, not the user's)."""
        if not self._distributed:
            return set()
        return {str(g.group_name) for g in (self._group, self._ctl)}

    @property
    def control_group(self) -> Any:
        """A gloo group of every rank for small main-thread agreements (None when not distributed)."""
        return self._ctl

    def _agree_finite(self, loss: float | None, state: Mapping[str, Any]) -> tuple[bool, float | None]:
        """Whether every rank's loss and every parameter of the state's modules is finite, and the mean
        loss (None when a rank reported none). A rank without a loss counts as finite."""
        modules = [o for o in state.values() if isinstance(o, nn.Module)]
        has_loss = loss is not None
        ok = (loss is None or math.isfinite(loss)) and all(
            bool(torch.isfinite(p).all()) for m in modules for p in m.parameters())
        t = torch.tensor([loss if ok and loss is not None else 0.0, 0.0 if ok else 1.0, 0.0 if has_loss else 1.0],
                         dtype=torch.float64)
        if self._distributed:
            dist.all_reduce(t, group=self._ctl)
        if t[1] > 0:
            return False, None
        return True, (None if t[2] > 0 else float(t[0]) / self.world_size)

    # -- restore -----------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Stateful], hint: Location | None = None) -> int:
        """Restore the newest valid checkpoint (root and ``hint``) into the named ``state`` objects;
        the step restored, 0 when none."""
        state = check_state(state)
        choice: str | None = None
        if self.rank == 0:
            manifest, skipped = choose(None if self._temporary else self.root, hint)
            for bad in skipped:
                log.error("skipping checkpoint %s: %s", bad.directory, bad.reason)
                self._send(CheckpointSample(job_id=self.job_id, step=bad.step, ts=time.time(), path=str(bad.directory),
                                            valid=False, world_size=bad.world_size, message=bad.reason[:1024]))
            if manifest is not None:
                choice = str(manifest.directory)
            # Invalid folders newer than the one restored are dropped, so a save of the same step
            # never writes into them.
            assert self.root is not None
            floor = manifest.step if manifest is not None else -1
            for s, d in list_step_dirs(self.root):
                if s > floor and same(d) != (same(manifest.directory) if manifest else None):
                    log.warning("removing invalid checkpoint %s (newer than the one restored)", d)
                    remove_dir(d)
            if manifest is None and skipped:
                log.error("no valid checkpoint left: starting from step 1")
        choice = self._broadcast_object(choice)
        if choice is None:
            return 0
        return restore(as_location(choice), rank=self.rank, world_size=self.world_size, state=state, verify_checksums=False)

    # -- save --------------------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Stateful], loss: float | None, *, wait: bool = False) -> bool:
        """Checkpoint the named ``state`` after ``step`` unless some rank's loss or parameters are non-finite.

        Returns whether a checkpoint was started. ``wait``: return once it is complete (manifest
        written). Every rank must call this at the same step with the same names.
        """
        state = check_state(state)
        self.wait()  # one save in flight at a time
        assert self.root is not None
        directory = step_dir(self.root, step)
        if self.rank == 0 and exists(directory):
            remove_dir(directory)  # a leftover of an earlier attempt; before the collective below
        finite, mean_loss = self._agree_finite(loss, state)  # also the barrier after that removal
        if not finite:
            self.skipped_steps.append(step)
            if self.rank == 0:
                log.warning("not checkpointing step %d: a rank's loss or parameters are not finite", step)
            return False
        flat = _save_state(step, self.rank, self.world_size, state)
        future: concurrent.futures.Future[Any] | None = None
        if self.async_save:
            try:
                started = dcp.async_save(flat, storage_writer=dcp_writer(directory),
                                         process_group=self._group)
                future = started if isinstance(started, concurrent.futures.Future) else started.upload_completion
            except (AssertionError, RuntimeError, ValueError) as e:  # backend without async support
                log.warning("async checkpointing unavailable (%s); saving synchronously from now on", e)
                self.async_save = False
        if future is None:
            future = concurrent.futures.Future()
            try:
                dcp.save(flat, storage_writer=dcp_writer(directory), process_group=self._group)
                future.set_result(None)
            except Exception as e:  # noqa: BLE001 - handed to the future, reported when collected
                future.set_exception(e)
        if self.rank == 0:
            if self._finisher is not None:
                future = self._finisher.submit(self._complete, future, step, directory, mean_loss)
            else:
                done: concurrent.futures.Future[Any] = concurrent.futures.Future()
                try:
                    done.set_result(self._complete(future, step, directory, mean_loss))
                except Exception as e:  # noqa: BLE001 - handed to the future, reported when collected
                    done.set_exception(e)
                future = done
        self._pending = _Pending(step=step, directory=directory, future=future, loss=mean_loss)
        self.saved_steps.append(step)
        if wait or not self.async_save:
            self.wait()
        return True

    def _complete(self, written: concurrent.futures.Future[Any], step: int, directory: Location,
                  loss: float | None) -> Manifest:
        written.result()  # re-raises a failed write
        manifest = write_manifest(directory, step=step, world_size=self.world_size, loss=loss, job_id=self.job_id)
        assert self.root is not None
        removed = prune(self.root, self.keep_last)
        if removed:
            log.info("retention: removed %s", ", ".join(name_of(d) for d in removed))
        return manifest

    def poll(self) -> None:
        """Collect a finished save, if any (never blocks); rank 0 then reports it."""
        if self._pending is not None and self._pending.future.done():
            self._collect()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending.future])
            self._collect()

    def _collect(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            result = pending.future.result()
        except Exception as e:  # noqa: BLE001 - a failed checkpoint is logged; training goes on
            log.error("checkpoint of step %d failed: %s: %s", pending.step, type(e).__name__, e)
            return
        if self.rank == 0 and isinstance(result, Manifest):
            self._completed = result
            log.info("checkpoint of step %d complete: %s (%d files, %d bytes)", result.step, result.directory,
                     len(result.files), result.total_bytes)
            self._send(CheckpointSample(
                job_id=self.job_id, step=result.step, ts=time.time(), path=str(result.directory), valid=True,
                world_size=result.world_size, files=len(result.files), bytes=result.total_bytes,
                manifest_sha256=result.sha256, loss=result.loss,
            ))

    def _send(self, sample: CheckpointSample) -> None:
        if self.sink is not None:
            try:
                self.sink.send_checkpoint(sample)
            except Exception as e:  # noqa: BLE001 - telemetry never stops training
                log.warning("cannot send checkpoint sample: %s", e)

    def reportable(self) -> Manifest | None:
        """The newest complete checkpoint not reported yet (the same answer on every rank; collective).

        Rank 0 knows completion; it tells the others which step (or none). Other ranks get a
        :class:`Manifest` with only ``directory`` and ``step`` meaningful.
        """
        newest = self._completed if self.rank == 0 else None
        step = newest.step if newest is not None and newest.step > self._reported_step else -1
        step = int(self._broadcast_object(step))
        if step < 0:
            return None
        self._reported_step = step
        if self.rank == 0 and newest is not None:
            return newest
        assert self.root is not None
        return Manifest(directory=step_dir(self.root, step), step=step, world_size=self.world_size, files={},
                        sha256="")

    def abort(self) -> None:
        """After a failure on this rank: no collectives, no waiting; a save in flight is left to fail
        (it never gets a manifest, so it never counts)."""
        self._pending = None
        if self._finisher is not None:
            self._finisher.shutdown(wait=False, cancel_futures=True)
            self._finisher = None
        if self._temporary and self.rank == 0 and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Wait for the save in flight; delete a temporary root (after every rank is done with it)."""
        try:
            self.wait()
        finally:
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None
            if self._temporary:
                if self._distributed:
                    dist.barrier(group=self._ctl)
                if self.rank == 0 and self.root is not None:
                    shutil.rmtree(self.root, ignore_errors=True)
            for group in (self._group, self._ctl):
                if group is not None:
                    try:
                        dist.destroy_process_group(group)
                    except (RuntimeError, ValueError):
                        pass
            self._group = self._ctl = None
