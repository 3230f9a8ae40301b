"""The runner and its thread: :class:`CommandRunner` (the state machine: poll, execute each new command
once, in id order, under a timeout, answer in order) and :class:`CommandLoop` (the thread that
steps it, apart from the shipper).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from agent.commands.errors import _fit
from agent.commands.transport import CommandTransport
from vigil.contract.background import BackgroundLoop
from vigil.contract.client import ApiError
from vigil.contract.schemas import CommandKind, CommandResult, NodeCommand

log = logging.getLogger(__name__)

#: Most command ids remembered as done.
MAX_REMEMBERED = 10_000


class Executor(Protocol):
    def run(self, kind: str | CommandKind, args: Mapping[str, Any]) -> CommandResult: ...

    def timeout_s(self, kind: str | CommandKind, args: Mapping[str, Any]) -> float: ...

    def close(self) -> None: ...


#: HTTP answers after which a result is dropped instead of posted again: the command is gone (404)
#: or the result itself is refused (400/409/422); retrying would only repeat them.
DROP_STATUSES = frozenset({400, 404, 409, 422})


@dataclass
class RunnerStats:
    polls: int = 0
    failed_polls: int = 0
    executed: int = 0
    failed_commands: int = 0
    timed_out: int = 0
    posted: int = 0
    failed_posts: int = 0
    dropped_results: int = 0


class CommandRunner:
    """Poll, execute in order at most once, answer. Single-threaded: call :meth:`step`."""

    def __init__(
        self,
        node_id: str,
        transport: CommandTransport,
        executor: Executor,
        on_node_lost: Callable[[], None] = lambda: None,
        lost_post_tries: int = 3,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.transport = transport
        self.executor = executor
        self.stats = RunnerStats()
        self._on_node_lost = on_node_lost
        self._lost_post_tries = lost_post_tries
        self._done: OrderedDict[int, None] = OrderedDict()
        self._unposted: list[tuple[int, CommandResult]] = []
        self._log_every_s = log_every_s
        self._clock = clock
        self._last_warning = float("-inf")
        #: Set after kill_node: the node is lost; the runner does nothing more.
        self.stopped = False
        #: A command is being carried out (not a poll, which may be a long one).
        self.executing = False
        self._halt = threading.Event()

    def halt(self) -> None:
        """Agent shutdown: finish the command under way, start no other (thread-safe)."""
        self._halt.set()

    @property
    def unposted(self) -> int:
        return len(self._unposted)

    def done(self, command_id: int) -> bool:
        return command_id in self._done

    def step(self) -> bool:
        """One poll: post what is owed, fetch, run each new command in id order and answer it.

        Returns True when a command was carried out (the caller should poll again at once).
        """
        if self.stopped or self._halt.is_set():
            return False
        self._post_unposted()
        try:
            commands = self.transport.fetch()
            self.stats.polls += 1
        except Exception as exc:  # noqa: BLE001 - HTTP, validation, anything: try again next interval
            self.stats.failed_polls += 1
            self._warn(f"cannot fetch commands for node {self.node_id}: {_describe(exc)}")
            return False
        did = False
        for cmd in sorted(commands, key=lambda c: c.id):
            if self._halt.is_set():
                break
            if cmd.id in self._done:
                continue
            result = self._execute(cmd)
            self._remember(cmd.id)
            did = True
            self._unposted.append((cmd.id, result))
            if cmd.kind == CommandKind.KILL_NODE and result.ok:
                self._post_unposted(tries=self._lost_post_tries)
                log.warning("node %s killed by command %d: the agent stops", self.node_id, cmd.id)
                self.stopped = True
                self._on_node_lost()
                return True
            self._post_unposted()
        return did

    def _execute(self, cmd: NodeCommand) -> CommandResult:
        kind, args = cmd.kind, dict(cmd.args)
        if cmd.node_id != self.node_id:
            result = CommandResult(
                ok=False,
                message=_fit(f"command for node {cmd.node_id!r} sent to the agent of {self.node_id!r}"),
            )
        else:
            timeout = self.executor.timeout_s(kind, args)
            box: list[CommandResult] = []
            worker = threading.Thread(
                target=lambda: box.append(self.executor.run(kind, args)),
                name=f"vigil-command-{cmd.id}",
                daemon=True,
            )
            started = self._clock()
            self.executing = True
            try:
                worker.start()
                worker.join(timeout)
            finally:
                self.executing = False
            if box:
                result = box[0]
            else:
                self.stats.timed_out += 1
                result = CommandResult(
                    ok=False,
                    message=f"{_kind(kind)} timed out after {timeout:g}s (it may still complete on the node)",
                )
            result.output.setdefault("duration_s", round(self._clock() - started, 3))
        self.stats.executed += 1
        if not result.ok:
            self.stats.failed_commands += 1
        (log.info if result.ok else log.warning)(
            "command %d %s %s: %s%s",
            cmd.id,
            _kind(kind),
            _summary(args),
            "ok" if result.ok else "FAILED",
            f" ({result.message})" if result.message else "",
        )
        return result

    def _remember(self, command_id: int) -> None:
        self._done[command_id] = None
        while len(self._done) > MAX_REMEMBERED:
            self._done.popitem(last=False)

    def _post_unposted(self, tries: int = 1) -> None:
        """Post owed results in command order; stop at the first failure (the rest wait for it)."""
        while self._unposted:
            command_id, result = self._unposted[0]
            if not self._post_one(command_id, result, tries):
                return
            self._unposted.pop(0)

    def _post_one(self, command_id: int, result: CommandResult, tries: int) -> bool:
        """True when the result is settled (posted, or refused for good); False: try again later."""
        error: BaseException | None = None
        for attempt in range(tries):
            if attempt:
                time.sleep(min(1.0, 0.2 * 2 ** (attempt - 1)))
            try:
                self.transport.post_result(command_id, result)
            except ApiError as exc:
                if exc.status_code in DROP_STATUSES:
                    self.stats.dropped_results += 1
                    log.error(
                        "result of command %d refused with HTTP %d (%s); dropping it",
                        command_id,
                        exc.status_code,
                        exc.detail,
                    )
                    return True
                error = exc
            except (httpx.HTTPError, ValidationError, OSError) as exc:
                error = exc
            else:
                self.stats.posted += 1
                return True
            self.stats.failed_posts += 1
        self._warn(f"cannot post the result of command {command_id}: {_describe(error)}")
        return False

    def _warn(self, message: str) -> None:
        now = self._clock()
        if now - self._last_warning >= self._log_every_s:
            log.warning("%s", message)
            self._last_warning = now
        else:
            log.debug("%s", message)

    def close(self) -> None:
        self.executor.close()


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, ApiError):
        return f"HTTP {exc.status_code}: {exc.detail}"
    return f"{type(exc).__name__}: {exc}"


def _kind(kind: str | CommandKind) -> str:
    return kind.value if isinstance(kind, CommandKind) else str(kind)


def _summary(args: Mapping[str, Any]) -> str:
    text = json.dumps(args, sort_keys=True, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


class CommandLoop(BackgroundLoop):
    """Steps a :class:`CommandRunner` in its own thread: a poll every ``interval_s`` (counted from the
    start of the last one: a long poll that waited that long is followed by the next at once), at once
    after a command was done, and stops when the runner does (kill_node)."""

    thread_name = "vigil-agent-commands"

    def __init__(self, runner: CommandRunner, interval_s: float = 1.0) -> None:
        self.runner = runner
        self.interval_s = interval_s
        self._last_tick_s = 0.0
        super().__init__()

    def pause_s(self) -> float:
        return max(0.0, self.interval_s - self._last_tick_s)

    def tick(self) -> bool:
        if self.runner.stopped:
            self._stop.set()
            return False
        t0 = time.monotonic()
        try:
            again = self.runner.step()
        finally:
            self._last_tick_s = time.monotonic() - t0
        if self.runner.stopped:
            self._stop.set()
        return bool(again)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop polling (a command under way gets ``timeout`` to finish; a poll under way is not waited
        for: the runner carries out nothing more once halted), then end throttles."""
        self.runner.halt()
        super().stop(timeout if self.runner.executing else 0)
        self.runner.close()
