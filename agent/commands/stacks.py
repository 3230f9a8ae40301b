"""The stack kind of the executor: ``pyspy_dump`` (``py-spy dump`` of each rank in a small pool;
a stopped process is read without attaching).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from agent.commands.args import PyspyArgs, _validate
from agent.commands.config import ExecutorConfig
from agent.commands.errors import CommandError, _fit
from agent.commands.pids import _STOPPED_STATES, _child_env, _state
from vigil.contract.schemas import CommandResult

#: Longest stack text kept per rank (a process with thousands of threads stays postable).
MAX_STACK_CHARS = 256 * 1024


class StackKinds:
    """``pyspy_dump``.

    Mixed into :class:`~agent.commands.executor.CommandExecutor`, which provides what is declared here.
    """

    config: ExecutorConfig
    _target: Callable[[int], psutil.Process]

    # -- kinds: stacks ----------------------------------------------------------------------------
    def pyspy_binary(self) -> str | None:
        if self.config.pyspy_path:
            return self.config.pyspy_path if os.access(self.config.pyspy_path, os.X_OK) else None
        beside = Path(sys.executable).parent / "py-spy"
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        return shutil.which("py-spy")

    def pyspy_dump(self, args: Mapping[str, Any]) -> CommandResult:
        a: PyspyArgs = _validate(PyspyArgs, args)
        stacks: dict[str, str] = {}
        errors: dict[str, str] = {}
        states: dict[str, str] = {}
        binary = self.pyspy_binary()
        if binary is None:
            reason = "py-spy not found (next to the agent's python or on PATH)"
            errors = {str(r): reason for r in a.pids}
            out = {"available": False, "reason": reason, "stacks": {}, "errors": errors, "states": {}}
            return CommandResult(ok=False, message=reason, output=out)
        targets: dict[int, psutil.Process] = {}
        for rank, pid in sorted(a.pids.items()):
            try:
                targets[rank] = self._target(pid)
            except CommandError as exc:
                errors[str(rank)] = str(exc)
        workers = max(1, min(self.config.pyspy_workers, len(targets)))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vigil-pyspy") as pool:
            futures = {rank: pool.submit(self._dump_one, binary, proc) for rank, proc in targets.items()}
            for rank, fut in futures.items():
                text, error, state = fut.result()
                states[str(rank)] = state
                if text is not None:
                    stacks[str(rank)] = text
                else:
                    errors[str(rank)] = error or "py-spy failed"
        out = {"available": True, "job_id": a.job_id, "stacks": stacks, "errors": errors, "states": states}
        if stacks:
            msg = f"stacks of {len(stacks)} rank(s)" + (f", {len(errors)} failed" if errors else "")
            return CommandResult(ok=True, message=msg, output=out)
        first = next(iter(errors.values()), "no pids given")
        return CommandResult(ok=False, message=_fit(f"no stack collected: {first}"), output=out)

    def _dump_one(self, binary: str, proc: psutil.Process) -> tuple[str | None, str | None, str]:
        """(stack text, error, process state). A stopped (hung) process is read without
        attaching: py-spy's default mode must suspend the process with ptrace, which fails on one
        that is already stopped, and would let it run on detach."""
        state = _state(proc)
        modes = [["--nonblocking"]] if state in _STOPPED_STATES else [[], ["--nonblocking"]]
        error = None
        for extra in modes:
            argv = [binary, "dump", "--pid", str(proc.pid), *extra]
            try:
                r = subprocess.run(
                    argv,
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=self.config.pyspy_timeout_s,
                    stdin=subprocess.DEVNULL,
                    env=_child_env(),
                )
            except subprocess.TimeoutExpired:
                error = f"py-spy timed out after {self.config.pyspy_timeout_s:g}s"
                continue
            except OSError as exc:
                return None, f"cannot run py-spy: {exc}", state
            err = (r.stderr or "").strip()
            if r.returncode == 0 and not err.startswith("Error") and r.stdout.strip():
                return r.stdout[:MAX_STACK_CHARS], None, state
            error = _pyspy_error(err or r.stdout, r.returncode)
        return None, error, state


def _pyspy_error(text: str, rc: int) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    # py-spy prints "Error: <what>" then "Caused by:" lines and a backtrace; keep what explains.
    keep = [ln for ln in lines if not ln[:1].isdigit() and not ln.startswith("Stack backtrace")][:4]
    msg = " / ".join(keep) or f"py-spy exited with {rc}"
    if any(w in msg for w in ("Permission denied", "Operation not permitted", "EPERM")):
        msg += " (py-spy needs ptrace rights: root or CAP_SYS_PTRACE)"
    return _fit(msg, 1024)
