"""``recovery.policy: adapt`` on a rank: the adapt file (:class:`AdaptHook`) and the ranks' agreement on which
of its versions to run (:class:`Adaptation`).

When a link of the job degrades, the controller asks every rank for the job's more compressed setting
(``recovery.adapt.params``, e.g. a longer ``tau``), and later for the spec's own again. The node agent writes
each rank's adapt file (:func:`vigil.contract.settings.adapt_file_path`, beside the fault file), atomically,
with every version asked for so far, oldest first::

    {"versions": [{"version": 1, "params": {"tau": 48}}, {"version": 2, "params": {}}]}

``params`` override the optimizer's own ``optimizer.params`` (``{}``: its own setting). The rank looks at the
file once per step (one ``os.stat``, failing with ENOENT until the file exists; the file is read only when its
(inode, size, mtime) changes) and remembers every version it has read. A malformed file is logged and ignored
until it changes; the hook never raises into the loop.

Agreement: the agents write the ranks' files at different times, so a rank must not switch on its own (the
ranks of a local-step method would then sync at different steps, and their collectives no longer pair). At
every checkpoint boundary (``step % checkpoint.interval_steps == 0``, or every ``report_interval`` steps when
the job takes no checkpoints; every rank runs the same step numbers) each rank calls one all-reduce MIN
of the highest version it has read (tagged ``adapt``, counted by the communication layer like every other
collective, timed into the step's optimizer phase). The result is a version every rank has read; when it
is newer than the one applied, a second all-reduce checks that every rank holds the same params for it
(only then: that decision is the same on every rank), and every rank calls ``strategy.reconfigure`` at
the same point: the end of that step, after its optimizer step (:meth:`Session.step_closed
<vigil.rank.session.Session.step_closed>`), so the new setting counts from the next step on. Each rank
then logs the switch and reports it to the controller as a :class:`~vigil.contract.schemas.FaultSample`
with ``fault_kind="adapt"`` and ``fault_id`` the version.

After a restart: a new process starts from the spec's setting (a strategy's checkpoint does not hold its
``tau``). The versions already in the file count as read, and the session's first step is a boundary
too, so the ranks take the newest version they all hold at the end of that step instead of up to an
interval later (the controller's intent is still the file's newest version). Other jobs pay nothing: no
hook, no ``stat``, no collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vigil.comm import Comm
from vigil.contract.optimizer_params import OptimizerParams
from vigil.contract.schemas import (
    ADAPTABLE,
    FaultSample,
    JobCreate,
    OptimizerSpec,
    RecoveryPolicy,
    adapted_params,
)
from vigil.contract.settings import adapt_file_path
from vigil.optim.base import Strategy
from vigil.rank.context import RankContext
from vigil.rank.step import Step

log = logging.getLogger(__name__)

ADAPT_TAG = "adapt"
"""The tag of the agreement's collectives (:mod:`vigil.comm`)."""
ADAPT_KIND = "adapt"
"""``fault_kind`` of the sample a rank sends when it applies a version (how the controller tells it from a fault)."""
MAX_VERSIONS = 10_000
"""More versions than this in one file: malformed (a runaway writer)."""


def adapt_path(fault_file: Path | None, job_id: str, rank: int) -> Path | None:
    """This rank's adapt file: beside its fault file (the agent writes both in the same folder), None without one."""
    if fault_file is None:
        return None
    return fault_file.with_name(adapt_file_path(fault_file.parent, job_id, rank).name)


def parse_versions(body: Any) -> dict[int, dict[str, Any]]:
    """The versions of an adapt file's JSON body, version -> params; ``TypeError`` / ``ValueError`` naming what
    is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("versions"), list):
        raise TypeError('expected {"versions": [...]}')
    entries = body["versions"]
    if len(entries) > MAX_VERSIONS:
        raise ValueError(f"{len(entries)} versions, more than {MAX_VERSIONS}")
    out: dict[int, dict[str, Any]] = {}
    last = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise TypeError(f"versions[{i}]: expected an object")
        version, params = entry.get("version"), entry.get("params")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"versions[{i}].version: expected a positive integer, got {version!r}")
        if version <= last:
            raise ValueError(f"versions[{i}].version: {version} after {last} (versions increase)")
        if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
            raise TypeError(f"versions[{i}].params: expected an object")
        out[version], last = params, version
    return out


class AdaptHook:
    """This rank's adapt file: :meth:`poll` once per step; :attr:`versions` holds every version read."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.versions: dict[int, dict[str, Any]] = {}
        """Every version read so far (from this file's every content): version -> params overrides."""
        self._seen: tuple[int, int, int] | None = None

    @property
    def newest(self) -> int:
        """The highest version read so far (0: none)."""
        return max(self.versions, default=0)

    def poll(self) -> None:
        """Read the file if it changed since the last look (cheap otherwise: one ``os.stat``); never raises."""
        if self.path is None:
            return
        try:
            st = os.stat(self.path)
        except OSError:  # no adapt file yet: the common case (a removed one takes nothing back)
            return
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key == self._seen:
            return
        self._seen = key
        try:
            found = parse_versions(json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
            # A half-written file (the writer should rename into place) or a bad one: look again when it changes.
            log.warning("ignoring adapt file %s: %s", self.path, e)
            return
        for version, params in found.items():
            if version in self.versions and self.versions[version] != params:
                log.warning("adapt file %s: version %d now says %s (was %s)", self.path, version, params,
                            self.versions[version])
        self.versions.update(found)


def params_digest(params: dict[str, Any] | None) -> int:
    """A 56-bit digest of ``params`` (0 for None), equal on every rank that holds the same params."""
    if params is None:
        return 0
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return 1 + int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


@dataclass
class _Target:
    """A strategy that adapts, with the job spec as its optimizer was built (code may override the spec's)."""

    strategy: Strategy
    spec: JobCreate
    params: OptimizerParams
    """Its typed params now."""


def _changes(old: OptimizerParams, new: OptimizerParams) -> str:
    """``"tau 12 -> 48"``: the fields that differ (``"unchanged"`` when none does)."""
    diff = [f"{f.name} {getattr(old, f.name)} -> {getattr(new, f.name)}" for f in dataclasses.fields(new)
            if getattr(old, f.name) != getattr(new, f.name)]
    return ", ".join(diff) or "unchanged"


class Adaptation:
    """``recovery.policy: adapt`` on one rank: the hook, and the agreement at checkpoint boundaries."""

    def __init__(self, hook: AdaptHook, comm: Comm, *, every: int, job_id: str, rank: int,
                 send: Callable[[FaultSample], None] | None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.hook = hook
        self.comm = comm
        self.every = every
        """Steps between boundaries (the job's checkpoint interval)."""
        self.job_id, self.rank, self.send = job_id, rank, send
        self.applied = 0
        """The version every rank runs now (0: the optimizer's own setting, as built)."""
        self.targets: list[_Target] = []
        self._first = True

    @classmethod
    def of(cls, ctx: RankContext, spec: JobCreate, comm: Comm) -> Adaptation | None:
        """The session's adaptation; None unless ``spec.recovery.policy`` is ``adapt`` (other jobs pay nothing)."""
        if spec.recovery.policy != RecoveryPolicy.ADAPT:
            return None
        path = adapt_path(ctx.fault_file, ctx.job_id, ctx.rank)
        if path is None:
            log.warning("adapt: rank %d has no adapt file (no fault file path); it agrees to no new setting", ctx.rank)
        return cls(AdaptHook(path), comm, every=spec.checkpoint.interval_steps or ctx.report_interval,
                   job_id=ctx.job_id, rank=ctx.rank, send=getattr(ctx.telemetry, "send_fault", None))

    def add(self, strategy: Strategy, job: JobCreate, optimizer: OptimizerSpec) -> None:
        """A strategy the session built (every rank, same order) from ``optimizer`` (the job spec's, or code's)."""
        if optimizer.kind not in ADAPTABLE:
            log.warning("adapt: optimizer %r cannot change while it runs; the job's adapt versions leave it alone",
                        optimizer.kind)
            return
        own = job.model_copy(update={"optimizer": optimizer})
        self.targets.append(_Target(strategy, own, adapted_params(own, {})))

    def step_ended(self, step: Step, attempt: int) -> None:
        """End of ``step`` (every rank, after its optimizer step): poll; at a boundary, agree and maybe apply."""
        self.hook.poll()
        if not self.targets or not (self._first or step.number % self.every == 0):
            return
        self._first = False
        t = time.perf_counter()
        try:
            version = self._agree()
            if version > self.applied and self._same_everywhere(version):
                self._apply(version, step.number, attempt)
        finally:
            step.add_time("optimizer", time.perf_counter() - t)

    def _agree(self) -> int:
        """The highest version every rank has read (collective)."""
        t = torch.tensor([self.hook.newest], dtype=torch.int64)
        self.comm.all_reduce(t, dist.ReduceOp.MIN, tag=ADAPT_TAG, elements=0)
        return int(t[0])

    def _same_everywhere(self, version: int) -> bool:
        """Whether every rank holds the same params for ``version`` (collective; the files of a correct
        controller always do: this keeps a bad one from making the ranks diverge)."""
        digest = params_digest(self.hook.versions.get(version))
        t = torch.tensor([digest, -digest], dtype=torch.int64)
        self.comm.all_reduce(t, dist.ReduceOp.MIN, tag=ADAPT_TAG, elements=0)
        low, high = int(t[0]), -int(t[1])
        if low == 0 or low != high:
            log.error("adapt: version %d is %s; the ranks keep version %d", version,
                      "missing on some rank" if low == 0 else "not the same on every rank", self.applied)
            self.applied = version  # the same decision on every rank: not tried again
            return False
        return True

    def _apply(self, version: int, step: int, attempt: int) -> None:
        """Every rank, at the same step: reconfigure each strategy, log, tell the controller."""
        overrides = self.hook.versions[version]
        self.applied = version
        changes: list[str] = []
        try:
            news = [adapted_params(t.spec, overrides) for t in self.targets]  # all valid before any changes
            for target, new in zip(self.targets, news, strict=True):
                target.strategy.reconfigure(new)
                changes.append(_changes(target.params, new))
                target.params = new
        except (ValueError, NotImplementedError) as e:  # the same on every rank: the same params, strategies
            log.error("adapt: version %d (%s) cannot be applied: %s; the ranks keep their setting", version,
                      overrides, e)
            return
        log.warning("adapt: version %d (%s) from step %d", version, "; ".join(changes), step)
        if self.send is not None:
            self.send(FaultSample(job_id=self.job_id, rank=self.rank, step=step, attempt=attempt, ts=time.time(),
                                  fault_id=version, fault_kind=ADAPT_KIND))
