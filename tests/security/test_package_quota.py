"""Code packages are garbage-collected and each user has a quota (controller/package_store.py).

Before: every upload stayed on the controller's disk for good, and any `user` token could fill it. Now a
token keeps at most ``package_quota_bytes`` (413 naming the quota, nothing stored), and packages no recent
job uses are removed before each upload. A real controller over HTTP, real zips.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from controller.packages import pack_directory, package_path
from tests.live_controller import LiveController
from vigil.contract.client import ApiError
from vigil.contract.schemas import JobCreate


def package(tmp_path: Path, name: str, size: int = 1500) -> bytes:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "train.py").write_text("def train(config):\n    pass\n")
    (folder / "blob.bin").write_bytes(os.urandom(size))  # incompressible: the zip is about this size
    return pack_directory(folder)


@pytest.fixture
def ctl(tmp_path: Path):
    c = LiveController(tmp_path / "controller", package_quota_bytes=4000, package_keep_s=3600).start()
    try:
        yield c
    finally:
        c.stop()


def stored(ctl: LiveController, sha: str) -> bool:
    return package_path(ctl.app.state.settings.resolved_packages_dir(), sha).is_file()


def test_a_user_past_its_quota_is_refused_and_nothing_is_stored(ctl: LiveController, tmp_path: Path) -> None:
    p1, p2, p3 = (package(tmp_path, n) for n in ("p1", "p2", "p3"))
    with ctl.client("user") as user, ctl.client("admin") as admin:
        a, b = user.upload_package(p1), user.upload_package(p2)
        assert a.created and b.created
        assert not user.upload_package(p1).created  # its own package again: costs nothing more
        with pytest.raises(ApiError) as e:
            user.upload_package(p3)
        assert e.value.status_code == 413 and "package quota" in str(e.value) and "4000" in str(e.value)
        sha3 = hashlib.sha256(p3).hexdigest()
        assert not stored(ctl, sha3)
        assert admin.upload_package(p3).created  # an admin has no quota
        with ctl.client("user") as other:  # another user's token: a quota of its own
            assert not other.upload_package(p1).created


def test_packages_no_recent_job_uses_are_removed_and_free_the_quota(tmp_path: Path) -> None:
    with LiveController(tmp_path / "controller", package_quota_bytes=4000, package_keep_s=0) as ctl:
        p1, p2, p3 = (package(tmp_path, n) for n in ("p1", "p2", "p3"))
        with ctl.client("user") as user:
            used = user.upload_package(p1)
            job = user.submit_job(JobCreate(name="uses-p1", steps=1, working_dir=used.ref))
            unused = user.upload_package(p2)  # collects nothing: p1 is used by a job not ended
            assert stored(ctl, used.sha256) and stored(ctl, unused.sha256)
            user.upload_package(p3)  # p2: no job, uploaded before now (keep 0 s): removed
            assert stored(ctl, used.sha256) and not stored(ctl, unused.sha256)
            user.cancel_job(job.id)
            assert user.upload_package(p2).created  # p1's job ended: p1 and p3 go, p2 comes back within quota
            assert not stored(ctl, used.sha256)
            r = httpx.get(f"{ctl.url}/api/v1/packages/{used.sha256}", headers={"Authorization": f"Bearer {ctl.token()}"})
            assert r.status_code == 404
