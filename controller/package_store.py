"""Code packages over time: who uploaded what (a per-user quota), and removing those no recent job uses.

A package is kept while a job that has not ended uses it, or while less than ``package_keep_s`` has passed
since its upload and since a job using it was created or ended (a finished job may still be recovered or
submitted again). The rest is removed, file and rows, before every upload (uploads are what make the folder
grow) and counted in the upload's answer. A ``user`` token may keep ``package_quota_bytes`` of packages
stored; an upload beyond it is refused (413 naming the quota) and nothing is stored. An admin has no quota.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from controller.models import CodePackage, Job
from controller.packages import PackageInfo, parse_ref
from vigil.contract.schemas import JobStatus
from vigil.contract.schemas.jobs import TERMINAL_STATUSES

log = logging.getLogger(__name__)

_ACTIVE = [s.value for s in JobStatus if s not in TERMINAL_STATUSES]


class QuotaExceeded(ValueError):
    """An upload would take its user over ``package_quota_bytes``."""


@dataclass(frozen=True)
class Collected:
    removed: list[str]
    freed_bytes: int


def in_use(session: Session, keep_s: float, now: datetime) -> set[str]:
    """Digests of the packages that jobs not yet ended, or created or ended within ``keep_s``, use."""
    cutoff = now - timedelta(seconds=keep_s)
    specs = session.scalars(select(Job.spec).where(or_(Job.status.in_(_ACTIVE), Job.created_at >= cutoff,
                                                       Job.finished_at >= cutoff))).all()
    out: set[str] = set()
    for spec in specs:
        ref = (spec or {}).get("working_dir")
        if isinstance(ref, str) and ref:
            try:
                out.add(parse_ref(ref))
            except ValueError:
                continue
    return out


def collect(session: Session, packages_dir: Path, keep_s: float, now: datetime | None = None) -> Collected:
    """Remove every stored package nothing keeps (module docstring); its rows too, in the caller's transaction."""
    now = now or datetime.now(UTC)
    folder = Path(packages_dir)
    if not folder.is_dir():
        return Collected([], 0)
    used = in_use(session, keep_s, now)
    uploaded = dict(session.execute(select(CodePackage.sha256, func.max(CodePackage.uploaded_at))
                                    .group_by(CodePackage.sha256)).tuples().all())
    cutoff, removed, freed = now - timedelta(seconds=keep_s), [], 0
    for path in folder.glob("*.zip"):
        digest = path.stem
        if digest in used:
            continue
        st = path.stat()
        when = uploaded.get(digest) or datetime.fromtimestamp(st.st_mtime, UTC)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        if when >= cutoff:
            continue
        path.unlink(missing_ok=True)
        removed.append(digest)
        freed += st.st_size
    if removed:
        session.execute(delete(CodePackage).where(CodePackage.sha256.in_(removed)))
        log.info("removed %d code packages no recent job uses (%.1f MB)", len(removed), freed / 1e6)
    return Collected(removed, freed)


def check_quota(session: Session, owner: str, info: PackageInfo, quota: int | None) -> None:
    """QuotaExceeded when ``owner`` storing ``info`` goes over ``quota`` (None: no quota; a package the owner
    already holds costs nothing more)."""
    if quota is None:
        return
    if session.get(CodePackage, (info.sha256, owner)) is not None:
        return
    held = int(session.scalar(select(func.coalesce(func.sum(CodePackage.size), 0))
                              .where(CodePackage.owner == owner)) or 0)
    if held + info.size > quota:
        raise QuotaExceeded(f"package quota: this token keeps {held} bytes of packages; {info.size} more exceed its "
                            f"{quota} bytes (VIGIL_PACKAGE_QUOTA_BYTES). Packages no job has used for "
                            f"the keep time are removed on their own")


def claim(session: Session, owner: str, info: PackageInfo) -> None:
    """Record ``owner``'s upload of ``info`` (again: its time renewed)."""
    row = session.get(CodePackage, (info.sha256, owner))
    if row is None:
        session.add(CodePackage(sha256=info.sha256, owner=owner, size=info.size))
    else:
        row.uploaded_at = datetime.now(UTC)

