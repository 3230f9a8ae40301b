"""The agent's rank socket: bound safely, and each datagram's sender named by the kernel.

A rank says which process it is (``StepSample.pid``), and the agent later signals, stops and py-spies that
pid for the controller; so the claim is checked against the sender the kernel reports with the datagram
(``SO_PASSCRED`` / ``SCM_CREDENTIALS``: an unprivileged sender cannot forge it). See
:meth:`agent.receiver.Receiver.handle_datagram` for what is refused.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

#: Kernel receive queue we ask for, so bursts of datagrams wait in the socket, not in the ranks.
SOCKET_RCVBUF_BYTES = 4 << 20
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)


class SocketInUseError(RuntimeError):
    """Another live process already listens on the agent socket."""


@dataclass(frozen=True, slots=True)
class Sender:
    """A datagram's sender as the kernel saw it (pid in the agent's pid namespace)."""

    pid: int
    uid: int
    gid: int


def recv_with_sender(sock: socket.socket, buf: bytearray) -> tuple[int, Sender | None]:
    """Receive one datagram into ``buf``: its length and its sender (None when the kernel gave no
    credentials, e.g. a socket bound without ``SO_PASSCRED``)."""
    n, anc, _flags, _addr = sock.recvmsg_into([buf], _CMSG_SPACE)
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            return n, Sender(*_UCRED.unpack_from(data))
    return n, None


def bind_datagram_socket(path: Path, mode: int = 0o660, group: int | None = None) -> socket.socket:
    """Bind a unix datagram socket at ``path``: parents created, a stale socket file replaced.

    Refuses (``SocketInUseError``) when a live process already listens there, and refuses to
    remove anything at ``path`` that is not a socket. ``mode`` lets ranks of the same user (and
    group) write to it; ``group``: the socket file's group (the rank user's, when ranks run as one).
    Every datagram then carries its sender's credentials, written by the kernel (``SO_PASSCRED``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path} exists and is not a socket; not removing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            log.info("removing stale agent socket %s", path)
            path.unlink(missing_ok=True)
        else:
            raise SocketInUseError(f"another process already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(str(path))
        if group is not None:
            os.chown(path, -1, group)
        os.chmod(path, mode)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_RCVBUF_BYTES)
        except OSError:  # the kernel caps it at net.core.rmem_max; a smaller queue still works
            pass
    except BaseException:
        sock.close()
        raise
    return sock
