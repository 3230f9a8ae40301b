"""Attacks through code packages (``POST /packages``): archives that spell one path two ways, collide by case,
carry special modes, or declare so many entries that parsing their directory alone costs the controller
hundreds of MB. Findings of issue 23; each test failed on the code before the fix. The checks are the
controller's own (``controller.packages.validate_package``) on archives written byte by byte here.
"""

from __future__ import annotations

import io
import stat
import struct
import tracemalloc
import zipfile

import pytest

from controller.packages import PackageError, validate_package

LIMITS = {"max_bytes": 32 << 20, "max_unzipped_bytes": 64 << 20, "max_files": 1000}


def _zip(entries: list[tuple[str, bytes, int]]) -> bytes:
    """A zip of (name, data, unix mode) entries, the mode in the external attributes as Info-ZIP writes it."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return buf.getvalue()


FILE = stat.S_IFREG | 0o644


@pytest.mark.parametrize(
    ("entries", "rule"),
    [
        ([("a/./b.py", b"x", FILE)], "'.' and empty path segments"),
        ([("a//b.py", b"x", FILE)], "'.' and empty path segments"),
        ([("./train.py", b"x", FILE)], "'.' and empty path segments"),
        ([("model.py", b"x", FILE), ("Model.py", b"y", FILE)], "only by case"),
        ([("pkg/utils.py", b"x", FILE), ("PKG/utils.py", b"y", FILE)], "only by case"),
        ([("run.sh", b"#!/bin/sh", stat.S_IFREG | stat.S_ISUID | 0o755)], "setuid, setgid or sticky"),
        ([("tool", b"x", stat.S_IFREG | stat.S_ISGID | 0o755)], "setuid, setgid or sticky"),
        ([("fifo", b"", stat.S_IFIFO | 0o644)], "not a plain file or folder"),
        ([("dev", b"", stat.S_IFCHR | 0o644)], "not a plain file or folder"),
        ([("link", b"/etc/passwd", stat.S_IFLNK | 0o777)], "symbolic link"),
    ],
)
def test_an_archive_that_spells_a_path_twice_or_carries_special_modes_is_refused(
    entries: list[tuple[str, bytes, int]], rule: str
) -> None:
    with pytest.raises(PackageError, match=rule):
        validate_package(_zip(entries), **LIMITS)


def _many_entries(n: int) -> bytes:
    """A zip whose central directory lists ``n`` empty files: ~50 bytes of directory each (a 32 MiB upload
    holds about 600,000), written directly (zipfile would take minutes)."""
    local, central = io.BytesIO(), io.BytesIO()
    for i in range(n):
        name = f"f{i}".encode()
        offset = local.tell()
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0) + name)
        central.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, len(name), 0, 0, 0, 0,
                                  FILE << 16, offset) + name)
    cd = central.getvalue()
    count = min(n, 0xFFFF)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(cd), local.tell(), 0)
    if n > 0xFFFF:  # zip64: the true count in the zip64 end record
        z64_at = local.tell() + len(cd)
        z64 = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(cd), local.tell())
        locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, z64_at, 1)
        end = z64 + locator + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return local.getvalue() + cd + end


def test_the_entry_limit_is_checked_before_the_directory_is_parsed() -> None:
    data = _many_entries(300_000)
    assert len(data) < LIMITS["max_bytes"]
    tracemalloc.start()
    try:
        with pytest.raises(PackageError, match="300000 entries, over the limit of 1000"):
            validate_package(data, **LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Parsing this directory (zipfile's ZipInfo per entry) peaks at about 150 MB; its end record is 22 bytes.
    assert peak < 20 << 20, f"the refusal cost {peak >> 20} MB of memory"


def test_an_honest_project_still_passes() -> None:
    data = _zip([("train.py", b"print(1)\n", FILE), ("pkg/", b"", stat.S_IFDIR | 0o755),
                 ("pkg/model.py", b"X = 1\n", FILE), ("run.sh", b"#!/bin/sh\n", stat.S_IFREG | 0o755),
                 ("windows.txt", b"made on Windows: no mode", 0)])
    assert validate_package(data, **LIMITS).files == 4
