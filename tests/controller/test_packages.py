"""Code packages: packing a project (deterministic, excludes, no symlinks), the upload route (stored
once by hash, roles), the refusals (not a zip, escaping paths, symlinks, zip bombs, too many files,
too large: 4xx naming the rule, nothing stored), jobs that name a package, and what Ray is handed.

Needs: PostgreSQL on 127.0.0.1:5432 for the postgresql case of the job test.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controller.launcher import LaunchError, RayJobLauncher
from controller.models import Job
from controller.packages import (
    IGNORE_FILE,
    PackageError,
    pack_directory,
    store_package,
    validate_package,
)
from tests.auth import bearer, issue_token
from tests.controller.fakes import FakeLauncher
from tests.harness import build_app, settings_for
from vigil.contract.schemas import JobCreate

API = "/api/v1"
ZIP = {"Content-Type": "application/zip"}


def _project(root: Path) -> Path:
    """A small user project with things that must stay out of the package."""
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "train.py").write_text("def train_func(config):\n    return config\n")
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "data.bin").write_bytes(os.urandom(1000))
    for junk in (".git/HEAD", "mypkg/__pycache__/train.cpython-311.pyc", ".venv/bin/python", "notes.log"):
        (root / junk).parent.mkdir(parents=True, exist_ok=True)
        (root / junk).write_text("junk")
    (root / IGNORE_FILE).write_text("# logs are not code\n*.log\n")
    return root


def _names(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.namelist()


def _zip(entries: dict[str, bytes], *, mode: int | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, content in entries.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if mode is not None:
                info.external_attr = mode << 16
            zf.writestr(info, content)
    return buf.getvalue()


LIMITS = {"max_bytes": 1 << 20, "max_unzipped_bytes": 1 << 20, "max_files": 100}


# --- packing ----------------------------------------------------------------------------------------


def test_pack_is_deterministic_flat_and_leaves_out_the_excluded(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    first = pack_directory(root)
    os.utime(root / "mypkg" / "train.py", (1, 1))  # times do not change the bytes
    assert pack_directory(root) == first
    assert sorted(_names(first)) == [IGNORE_FILE, "data.bin", "mypkg/__init__.py", "mypkg/train.py", "run.sh"]
    with zipfile.ZipFile(io.BytesIO(first)) as zf:
        assert zf.read("mypkg/train.py").startswith(b"def train_func")
        assert (zf.getinfo("run.sh").external_attr >> 16) & stat.S_IXUSR  # executables stay executable
    assert "data.bin" not in _names(pack_directory(root, ["*.bin"]))
    assert not any(n.startswith("mypkg/") for n in _names(pack_directory(root, ["mypkg/"])))


def test_pack_refuses_symlinks_missing_folders_empty_and_too_large(tmp_path: Path) -> None:
    root = _project(tmp_path / "proj")
    (root / "link.py").symlink_to(root / "mypkg" / "train.py")
    with pytest.raises(PackageError, match="link.py is a symbolic link"):
        pack_directory(root)
    assert "link.py" not in _names(pack_directory(root, ["link.py"]))  # excluded links are fine
    with pytest.raises(PackageError, match="not a folder"):
        pack_directory(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match="no files left"):
        pack_directory(tmp_path / "empty")
    with pytest.raises(PackageError, match="limit of 500 bytes"):
        pack_directory(root, ["link.py"], max_bytes=500)


# --- checking -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("data", "rule"), [
    (b"print('hello')\n", "not a zip"),
    (_zip({"../evil.py": b"x"}), "'..' would land outside"),
    (_zip({"a/../../evil.py": b"x"}), "'..' would land outside"),
    (_zip({"/etc/cron.d/evil": b"x"}), "absolute path"),
    (_zip({"C:/evil.py": b"x"}), "absolute path"),
    (_zip({"a\\..\\evil.py": b"x"}), "names use '/' only"),
    (_zip({"link": b"/etc/passwd"}, mode=stat.S_IFLNK | 0o777), "symbolic link"),
    (_zip({f"f{i}.py": b"" for i in range(101)}), "101 entries, over the limit of 100"),
    (_zip({"bomb.txt": b"\0" * (2 << 20)}), "zip bomb"),
    (_zip({"d/": b""}), "holds no files"),
])
def test_bad_packages_are_refused_naming_the_rule(tmp_path: Path, data: bytes, rule: str) -> None:
    with pytest.raises(PackageError, match=rule):
        store_package(data, tmp_path / "pk", **LIMITS)
    assert not (tmp_path / "pk").exists() or not list((tmp_path / "pk").iterdir())


def test_uncompressed_sizes_are_counted_not_read_from_the_headers(tmp_path: Path) -> None:
    """A zip whose headers claim a tiny file while the data inflates past the limit is still a bomb."""
    data = bytearray(_zip({"bomb.txt": b"\0" * (2 << 20)}))
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = zf.getinfo("bomb.txt")
        real = info.file_size
    lie = (10).to_bytes(4, "little")
    for header in (b"PK\x03\x04", b"PK\x01\x02"):  # local header and central directory: file_size fields
        at = data.find(header)
        offset = 22 if header == b"PK\x03\x04" else 24
        assert int.from_bytes(data[at + offset:at + offset + 4], "little") == real
        data[at + offset:at + offset + 4] = lie
    with pytest.raises(PackageError):
        validate_package(bytes(data), **LIMITS)


def test_duplicate_and_encrypted_entries_are_refused() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Duplicate name", UserWarning)
        zf.writestr("a.py", b"1")
        zf.writestr("a.py", b"2")
    with pytest.raises(PackageError, match="appears twice"):
        validate_package(buf.getvalue(), **LIMITS)
    data = bytearray(_zip({"a.py": b"x"}))
    for header, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # general purpose flag bit 0: encrypted
        at = data.find(header)
        data[at + offset] |= 0x1
    with pytest.raises(PackageError, match="encrypted"):
        validate_package(bytes(data), **LIMITS)


def test_store_is_content_addressed_and_idempotent(tmp_path: Path) -> None:
    data = pack_directory(_project(tmp_path / "proj"))
    info, created = store_package(data, tmp_path / "pk", **LIMITS)
    assert created and info.sha256 == hashlib.sha256(data).hexdigest() and info.files == 5
    assert (tmp_path / "pk" / f"{info.sha256}.zip").read_bytes() == data
    again, created = store_package(data, tmp_path / "pk", **LIMITS)
    assert not created and again == info
    assert sorted(p.name for p in (tmp_path / "pk").iterdir()) == [f"{info.sha256}.zip"]  # no temp files left


# --- the routes -----------------------------------------------------------------------------------


def _app(db_url: str, home: Path, launcher: FakeLauncher | None = None, **settings: Any):  # type: ignore[no-untyped-def]
    return build_app(settings_for(home, db_url, **settings), launcher=launcher or FakeLauncher())


@pytest.fixture
def app(sqlite_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    return _app(sqlite_url, tmp_path / "home", max_package_bytes=64 * 1024, max_package_unzipped_bytes=1 << 20,
                max_package_files=50)


@pytest.fixture
def client(app) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(app, headers=bearer(issue_token(app, "user"))) as c:
        yield c


def test_upload_then_get_then_upload_again(client: TestClient, tmp_path: Path) -> None:
    data = pack_directory(_project(tmp_path / "proj"))
    sha = hashlib.sha256(data).hexdigest()
    r = client.post(f"{API}/packages", content=data, headers=ZIP)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["ref"] == f"sha256:{sha}" and body["files"] == 5 and body["size"] == len(data) and body["created"]
    r = client.post(f"{API}/packages", content=data, headers=ZIP)
    assert r.status_code == 200 and not r.json()["created"]
    r = client.get(f"{API}/packages/{sha}")
    assert r.status_code == 200 and r.json()["files"] == 5
    assert client.get(f"{API}/packages/{'0' * 64}").status_code == 404
    assert client.get(f"{API}/packages/not-a-hash").status_code == 422


def test_refused_uploads_say_why_and_store_nothing(app, client: TestClient, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    packages = tmp_path / "home" / "packages"
    cases = [
        (b"PK not really", ZIP, 422, "not a zip"),
        (_zip({"../evil.py": b"x"}), ZIP, 422, "'..'"),
        (_zip({"link": b"/etc/passwd"}, mode=stat.S_IFLNK | 0o777), ZIP, 422, "symbolic link"),
        (_zip({"bomb.txt": b"\0" * (4 << 20)}), ZIP, 422, "zip bomb"),
        (_zip({f"f{i}.py": b"" for i in range(51)}), ZIP, 422, "over the limit of 50"),
        (os.urandom(70 * 1024), ZIP, 413, str(64 * 1024)),
        (_zip({"a.py": b"x"}), {"Content-Type": "application/json"}, 415, "application/zip"),
    ]
    for data, headers, code, needle in cases:
        r = client.post(f"{API}/packages", content=data, headers=headers)
        assert r.status_code == code, (needle, r.status_code, r.text)
        assert needle in str(r.json()["detail"]), (needle, r.json())
    assert not packages.exists() or not list(packages.iterdir())


def test_the_upload_limit_is_its_own(sqlite_url: str, tmp_path: Path) -> None:
    """Packages have their own size limit; every other route keeps the general one."""
    app = _app(sqlite_url, tmp_path / "home", max_body_bytes=16 * 1024, max_package_bytes=64 * 1024)
    big = _zip({"model.py": os.urandom(40 * 1024)})  # incompressible: over the general limit, under the package one
    with TestClient(app, headers=bearer(issue_token(app, "user"))) as client:
        assert client.post(f"{API}/packages", content=big, headers=ZIP).status_code == 201
        r = client.post(f"{API}/jobs", content=b"{" + b" " * len(big) + b"}", headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and str(16 * 1024) in r.json()["detail"]


@pytest.mark.parametrize(("role", "code"), [("admin", 201), ("user", 201), ("viewer", 403), ("agent", 403),
                                            ("job", 403)])
def test_who_may_upload(app, client: TestClient, role: str, code: int) -> None:  # type: ignore[no-untyped-def]
    kw = {"job_id": client.post(f"{API}/jobs", json={"name": "j"}).json()["id"]} if role == "job" else {}
    token = issue_token(app, role, **kw)
    r = client.post(f"{API}/packages", content=_zip({"a.py": role.encode()}), headers={**ZIP, **bearer(token)})
    assert r.status_code == code, r.text
    if code == 201:
        assert client.get(f"{API}/packages/{r.json()['sha256']}", headers=bearer(issue_token(app, "viewer"))).status_code == 200


# --- jobs that name a package ---------------------------------------------------------------------


def test_a_job_names_a_stored_package_or_is_refused(db_url: str, tmp_path: Path) -> None:
    launcher = FakeLauncher()
    app = _app(db_url, tmp_path / "home", launcher)
    with TestClient(app, headers=bearer(issue_token(app, "user"))) as client:
        spec = {"name": "mine", "entrypoint": "python train.py --epochs 3", "working_dir": f"sha256:{'a' * 64}"}
        r = client.post(f"{API}/jobs", json=spec)
        assert r.status_code == 422 and "working_dir" in str(r.json()["detail"]) and "uploaded" in r.text
        with app.state.sessions() as s:
            assert s.scalar(select(func.count()).select_from(Job)) == 0
        data = pack_directory(_project(tmp_path / "proj"))
        ref = client.post(f"{API}/packages", content=data, headers=ZIP).json()["ref"]
        r = client.post(f"{API}/jobs", json={**spec, "working_dir": ref})
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["working_dir"] == ref
        assert launcher.submitted == [] or launcher.submitted[0][1].working_dir == ref


def test_ray_gets_the_stored_zip_and_the_pip_requirements(tmp_path: Path) -> None:
    data = pack_directory(_project(tmp_path / "proj"))
    info, _ = store_package(data, tmp_path / "pk", **LIMITS)
    launcher = object.__new__(RayJobLauncher)  # no cluster: only the runtime environment is built
    launcher.packages_dir = tmp_path / "pk"
    spec = JobCreate(name="mine", entrypoint="python train.py", working_dir=info.ref, pip=["tqdm==4.66.5"])
    env = launcher.runtime_env("j1", spec, {"VIGIL_TOKEN": "t"})
    assert env["working_dir"] == str(tmp_path / "pk" / f"{info.sha256}.zip")
    assert env["pip"] == ["tqdm==4.66.5"]
    assert env["env_vars"]["VIGIL_JOB_ID"] == "j1" and env["env_vars"]["VIGIL_TOKEN"] == "t"
    assert env["env_vars"]["RAY_CHDIR_TO_TRIAL_DIR"] == "0"  # ranks run in the package, as the driver
    assert "working_dir" not in launcher.runtime_env("j2", JobCreate(name="demo"), {})
    missing = JobCreate(name="gone", entrypoint="python train.py", working_dir=f"sha256:{'b' * 64}")
    with pytest.raises(LaunchError, match="not stored"):
        launcher.runtime_env("j3", missing, {})
