"""Commands in a sandbox (asyncio API): run, background handles, re-attach,
PTYs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Union

from .._concurrency import AsyncAbort, AsyncCancelled, AsyncQueue, AsyncWorker, QueueTimeout, async_callback, async_iter_chunks, async_sleep
from .._protocol import (
    STDIN_CHUNK,
    CommandState,
    Output,
    argv,
    b64,
    backoff,
    checked,
    chunks,
    exec_body,
    split_stdin,
)
from ..exceptions import ConnectionLost, FailedPrecondition, InvalidArgument, NotFound, NotSupported, SandboxNotFound, ShoalError, Timeout
from ..models import CommandInfo, CommandResult, PtySize

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

_END = object()
_DEFAULT_TIMEOUT = 60.0
# The server sends a keep-alive event every 15 s on a silent command stream:
# a stream silent for this long is a dead connection, re-attached by offset.
_STREAM_READ_TIMEOUT = 75.0

# A callback gets a str (stdout, stderr), bytes (pty) or an event; with
# asyncio it may be a coroutine function.
Callback = Callable[[Any], Any]


async def _dispatch(out: Output, on_stdout: Optional[Callback], on_stderr: Optional[Callback], on_pty: Optional[Callback]) -> None:
    stdout, stderr, pty = out
    if stdout is not None:
        await async_callback(on_stdout, stdout)
    elif stderr is not None:
        await async_callback(on_stderr, stderr)
    elif pty is not None:
        await async_callback(on_pty, pty)


class _AsyncReader:
    """Reads one command's events, re-attaching by log offset when the
    connection breaks (ConnectCommand), until the end of its stream."""

    def __init__(self, commands: "AsyncCommands", state: CommandState) -> None:
        self._commands = commands
        self.state = state
        self.abort = AsyncAbort()
        self._events: AsyncIterator[Dict[str, Any]] = _no_events()
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        self.abort()
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:  # asyncio: a generator another task is reading raises RuntimeError
                pass

    async def outputs(self) -> AsyncIterator[Output]:
        """Output until the command's exit; the stream is then read to its
        end, so that its connection goes back to the pool."""
        attempt = 0
        resuming = False
        try:
            while True:
                try:
                    async for msg in self._events:
                        resuming = False
                        if self.state.done:
                            continue  # only the end of the stream is left
                        for out in self.state.feed(msg):
                            yield out
                        attempt = 0
                    if self.state.done or self._closed:
                        return
                    raise ConnectionLost("command stream ended before the command's exit")
                except ConnectionLost:
                    if self._closed or self.state.done:
                        return
                    if not self.state.can_resume() or attempt >= self._commands._t.config.retries:
                        raise
                    await async_sleep(backoff(attempt))
                    attempt += 1
                    resuming = True
                    self._events = self._commands._connect_events(self.state.command_id, self.state.offset, self.abort)
                except NotSupported:
                    if resuming:
                        raise ConnectionLost(
                            "the connection to the command broke and this server cannot re-attach to commands (no ConnectCommand)"
                        ) from None
                    raise
        finally:
            await self.close()


class AsyncCommandHandle:
    """A command running in a sandbox (E2B's ``AsyncCommandHandle``).

    Output is read in the background (a task; a thread when blocking) as it
    arrives; iterate over the handle (``async for``) for ``(stdout, stderr,
    pty)`` tuples (exactly one is not None) or ``await handle.wait()``. The
    command is a server-side object: :meth:`disconnect` stops reading without
    stopping it, and ``sb.commands.connect(handle.id, offset=handle.offset)``
    re-attaches later, even from another process.
    """

    def __init__(
        self,
        commands: "AsyncCommands",
        reader: _AsyncReader,
        *,
        check: bool,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        on_pty: Optional[Callback] = None,
    ) -> None:
        self._commands = commands
        self._reader = reader
        self._check = check
        self._callbacks = (on_stdout, on_stderr, on_pty)
        self._queue: "AsyncQueue[Any]" = AsyncQueue()
        self._error: Optional[BaseException] = None
        self._worker = AsyncWorker(self._pump, f"shoal-cmd-{self.id}")

    async def _pump(self) -> None:
        try:
            async for out in self._reader.outputs():
                await _dispatch(out, *self._callbacks)
                self._queue.put(out)
        except AsyncCancelled:
            pass
        except BaseException as e:  # handed to the caller of wait()/iteration
            self._error = e
        finally:
            self._queue.put(_END)

    # --- identity and progress ---

    @property
    def id(self) -> str:
        """The command's ID (use it with ``sb.commands.connect/kill/send_stdin``)."""
        return self._reader.state.command_id

    @property
    def pid(self) -> int:
        """The process ID inside the sandbox."""
        return self._reader.state.pid

    @property
    def offset(self) -> int:
        """Log offset just past the last event received: re-attach from here."""
        return self._reader.state.offset

    @property
    def stdout(self) -> str:
        """Standard output received so far."""
        return self._reader.state.stdout

    @property
    def stderr(self) -> str:
        """Standard error received so far."""
        return self._reader.state.stderr

    @property
    def exit_code(self) -> Optional[int]:
        """The exit code once the command ended, else None."""
        st = self._reader.state
        return st.result().exit_code if st.done else None

    @property
    def replayed(self) -> bool:
        """True when the command is a recorded trajectory step, not run again."""
        return self._reader.state.replayed

    # --- output ---

    def __aiter__(self) -> AsyncIterator[Output]:
        """Yield ``(stdout, stderr, pty)`` tuples until the command ends."""
        return self._iter()

    async def _iter(self) -> AsyncIterator[Output]:
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put(_END)
                if self._error is not None:
                    raise self._error
                return
            yield item

    async def wait(
        self,
        on_pty: Optional[Callback] = None,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        *,
        check: Optional[bool] = None,
        timeout: Optional[float] = None,
    ) -> CommandResult:
        """Wait for the command to end and return its result.

        With ``check=True`` (here, or given to ``run``) a non-zero exit
        raises :class:`CommandExitException` and a command killed by its own
        timeout raises :class:`CommandTimeout`; by default the result is
        returned, its ``exit_code`` telling how it ended.

        :param timeout: seconds to wait here; on expiry :class:`Timeout` is
            raised and the command keeps running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                item = await self._queue.get(left)
            except QueueTimeout:
                raise Timeout(f"command {self.id} still running after {timeout} s") from None
            if item is _END:
                self._queue.put(_END)
                break
            await _dispatch(item, on_stdout, on_stderr, on_pty)
        if self._error is not None:
            raise self._error
        return checked(self._reader.state.result(), self._check if check is None else check)

    # --- control ---

    async def kill(self) -> bool:
        """SIGKILL the command's process group. False if it was not found."""
        return await self._commands.kill(self.id)

    async def signal(self, signal: str = "SIGTERM") -> None:
        """Send a signal (``"SIGTERM"``, ``"SIGINT"``, ...) to the command's process group."""
        await self._commands.signal(self.id, signal)

    async def send_stdin(self, data: Union[str, bytes], request_timeout: Optional[float] = None) -> None:
        """Write to the command's stdin (start it with ``stdin=True``)."""
        await self._commands.send_stdin(self.id, data, request_timeout=request_timeout)

    async def close_stdin(self, request_timeout: Optional[float] = None) -> None:
        """Close the command's stdin (it sees end of file)."""
        await self._commands.close_stdin(self.id, request_timeout=request_timeout)

    async def resize(self, size: PtySize) -> None:
        """Resize the command's terminal (commands started with a PTY)."""
        await self._commands._resize(self.id, size)

    async def disconnect(self) -> None:
        """Stop receiving output; the command keeps running on the server."""
        await self._reader.close()
        await self._worker.stop()


class AsyncCommands:
    """``sb.commands``: run commands and manage running ones."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    @property
    def _t(self):  # type: ignore[no-untyped-def]
        return self._sb._transport

    async def run(
        self,
        cmd: Union[str, Sequence[str]],
        background: bool = False,
        envs: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        cwd: Optional[str] = None,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        stdin: Any = None,
        timeout: Optional[float] = _DEFAULT_TIMEOUT,
        request_timeout: Optional[float] = None,
        *,
        check: bool = False,
    ) -> Any:
        """Run a command; wait for it, or return a handle with ``background=True``.

        :param cmd: a string, run with ``sh -c``, or an argv list.
        :param background: return a :class:`CommandHandle` as soon as the
            command started instead of waiting for it.
        :param envs: extra environment variables.
        :param user: the sandbox user to run as (a name in its
            ``/etc/passwd``, or a uid): its ids, groups, ``HOME``, ``USER``
            and, without ``cwd``, its home. Default: root.
        :param cwd: working directory.
        :param on_stdout: called with each piece of stdout text as it arrives
            (with asyncio, a function or a coroutine function).
        :param on_stderr: called with each piece of stderr text.
        :param stdin: ``str``/``bytes`` to feed (then end of file), ``True``
            to keep stdin open for ``send_stdin()``, or a file object /
            iterable of bytes streamed in (with asyncio, also an async
            iterable).
        :param timeout: seconds after which the server kills the command's
            process group (E2B's default: 60); ``0`` or ``None``: no limit.
        :param request_timeout: seconds to wait for the server to answer.
        :param check: raise :class:`CommandExitException` on a non-zero exit
            (and :class:`CommandTimeout` on a timeout), as E2B's SDK does;
            by default (``False``) the result is returned either way.
        :return: :class:`CommandResult`, or :class:`CommandHandle` when
            ``background``.
        """
        inline, stdin_open, source = split_stdin(stdin)
        body = exec_body(self._sb.sandbox_id, argv(cmd), envs=envs, cwd=cwd, stdin=inline, stdin_open=stdin_open, timeout=timeout, user=user)
        return await self._exec(
            body,
            background=background,
            on_stdout=on_stdout,
            on_stderr=on_stderr,
            source=source,
            check=check,
            request_timeout=request_timeout,
        )

    async def _exec(
        self,
        body: Dict[str, Any],
        *,
        background: bool,
        check: bool,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        on_pty: Optional[Callback] = None,
        source: Any = None,
        request_timeout: Optional[float] = None,
        pty: bool = False,
    ) -> Any:
        trajectory = bool(body.get("trajectoryId"))
        state = CommandState(pty=pty, step=int(body.get("step") or 0))
        reader = _AsyncReader(self, state)
        reader._events = events = self._t.stream(
            "CommandService",
            "Exec",
            body,
            idempotent=trajectory,
            request_timeout=request_timeout,
            read_timeout=_STREAM_READ_TIMEOUT,
            trajectory=trajectory,
            abort=reader.abort,
        )
        # Read up to the `started` event, so the handle knows the command's ID.
        try:
            async for msg in events:
                state.feed(msg)
                if state.started:
                    break
            else:
                raise ConnectionLost("Exec stream ended before the command started")
        except BaseException:
            await reader.close()
            raise
        if source is not None:
            self._pump_stdin(state.command_id, source)
        if background:
            return AsyncCommandHandle(self, reader, check=check, on_stdout=on_stdout, on_stderr=on_stderr, on_pty=on_pty)
        try:
            async for out in reader.outputs():
                await _dispatch(out, on_stdout, on_stderr, on_pty)
        finally:
            await reader.close()
        return checked(state.result(), check)

    def _pump_stdin(self, command_id: str, source: Any) -> None:
        async def pump() -> None:
            try:
                async for piece in async_iter_chunks(source, STDIN_CHUNK):
                    await self.send_stdin(command_id, piece)
                await self.close_stdin(command_id)
            except ShoalError:
                pass  # the command ended or went away; its result says so

        AsyncWorker(pump, f"shoal-stdin-{command_id}")

    def _connect_events(self, command_id: str, offset: int, abort: Optional[AsyncAbort] = None) -> AsyncIterator[Dict[str, Any]]:
        return self._t.stream(
            "CommandService",
            "ConnectCommand",
            {"sandboxId": self._sb.sandbox_id, "commandId": command_id, "offset": str(int(offset))},
            idempotent=True,
            read_timeout=_STREAM_READ_TIMEOUT,
            abort=abort,
        )

    async def connect(
        self,
        cmd_id: str,
        offset: int = 0,
        timeout: Optional[float] = None,
        request_timeout: Optional[float] = None,
        on_stdout: Optional[Callback] = None,
        on_stderr: Optional[Callback] = None,
        *,
        check: bool = False,
    ) -> AsyncCommandHandle:
        """Re-attach to a command (after a disconnect, or from another process).

        :param cmd_id: the command's ID (``handle.id``; a pid from E2B code
            is looked up in ``list()``).
        :param offset: log offset to continue from (``handle.offset``): each
            byte after it arrives exactly once. ``0`` replays everything.
        :param timeout: accepted for E2B compatibility; not used (the
            command's own timeout was set when it started).
        """
        info = await self.get(cmd_id, request_timeout=request_timeout)  # fails early: unknown ID, old server
        state = CommandState(command_id=info.id, pty=info.pty)
        state.pid = info.pid
        state.offset = int(offset)
        state.offsets_seen = True
        reader = _AsyncReader(self, state)
        reader._events = self._connect_events(info.id, offset, reader.abort)
        return AsyncCommandHandle(self, reader, check=check, on_stdout=on_stdout, on_stderr=on_stderr)

    async def list(self, request_timeout: Optional[float] = None) -> List[CommandInfo]:
        """The sandbox's commands (running and recently ended) as server-side objects."""
        r = await self._t.call("CommandService", "ListCommands", {"sandboxId": self._sb.sandbox_id}, idempotent=True, request_timeout=request_timeout)
        return [CommandInfo.from_json(c) for c in r.get("commands") or []]

    async def get(self, cmd_id: str, request_timeout: Optional[float] = None) -> CommandInfo:
        """One command's state, exit status and log size."""
        r = await self._t.call(
            "CommandService",
            "GetCommand",
            {"sandboxId": self._sb.sandbox_id, "commandId": await self._resolve(cmd_id)},
            idempotent=True,
            request_timeout=request_timeout,
        )
        return CommandInfo.from_json(r)

    async def wait(self, cmd_id: str, timeout: Optional[float] = None) -> CommandInfo:
        """Wait on the server for a command to end and return its record
        (no output: use ``(await connect(cmd_id)).wait()`` for that).

        :param timeout: seconds; on expiry the record of the still running
            command is returned.
        """
        body: Dict[str, Any] = {"sandboxId": self._sb.sandbox_id, "commandId": await self._resolve(cmd_id)}
        if timeout:
            body["timeoutMs"] = str(int(timeout * 1000))
        rt = timeout + self._t.config.request_timeout if timeout else 24 * 3600.0
        r = await self._t.call("CommandService", "WaitCommand", body, idempotent=True, request_timeout=rt)
        return CommandInfo.from_json(r)

    async def kill(self, cmd_id: Union[str, int], request_timeout: Optional[float] = None) -> bool:
        """SIGKILL a command's process group. False if there was no such
        command or it had already exited (E2B's behaviour)."""
        try:
            await self.signal(cmd_id, "SIGKILL", request_timeout=request_timeout)
            return True
        except SandboxNotFound:
            raise
        except (NotFound, FailedPrecondition):  # unknown, or exited already
            return False

    async def signal(self, cmd_id: Union[str, int], signal: str = "SIGTERM", request_timeout: Optional[float] = None) -> None:
        """Send a signal to a command's process group."""
        await self._t.call(
            "CommandService",
            "SignalCommand",
            {"sandboxId": self._sb.sandbox_id, "commandId": await self._resolve(cmd_id), "signal": signal},
            idempotent=signal.upper() in ("SIGKILL", "KILL", "SIGTERM", "TERM"),
            request_timeout=request_timeout,
        )

    async def send_stdin(self, cmd_id: Union[str, int], data: Union[str, bytes], request_timeout: Optional[float] = None) -> None:
        """Write to the stdin of a command started with ``stdin=True``."""
        cid = await self._resolve(cmd_id)
        b = data.encode() if isinstance(data, str) else bytes(data)
        for piece in chunks(b, STDIN_CHUNK) if b else [b""]:
            await self._t.call(
                "CommandService",
                "SendStdin",
                {"sandboxId": self._sb.sandbox_id, "commandId": cid, "data": b64(piece)},
                idempotent=False,
                request_timeout=request_timeout,
            )

    async def close_stdin(self, cmd_id: Union[str, int], request_timeout: Optional[float] = None) -> None:
        """Close a command's stdin (it reads end of file)."""
        await self._t.call(
            "CommandService",
            "SendStdin",
            {"sandboxId": self._sb.sandbox_id, "commandId": await self._resolve(cmd_id), "close": True},
            idempotent=True,
            request_timeout=request_timeout,
        )

    async def _resize(self, cmd_id: Union[str, int], size: PtySize) -> None:
        await self._t.call(
            "CommandService",
            "ResizePty",
            {"sandboxId": self._sb.sandbox_id, "commandId": await self._resolve(cmd_id), "size": {"rows": size.rows, "cols": size.cols}},
            idempotent=True,
        )

    async def _resolve(self, cmd_id: Union[str, int]) -> str:
        """A command ID; E2B code passes pids, which are looked up."""
        if isinstance(cmd_id, int) and not isinstance(cmd_id, bool):
            for c in await self.list():
                if c.pid == cmd_id and c.state == "running":
                    return c.id
            raise NotFound(f"no running command with pid {cmd_id} in sandbox {self._sb.sandbox_id}")
        if not cmd_id:
            raise InvalidArgument("a command ID is required")
        return str(cmd_id)


async def _no_events() -> AsyncIterator[Dict[str, Any]]:
    return
    yield


class AsyncPty:
    """``sb.pty``: interactive terminals (E2B's names)."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    async def create(
        self,
        size: PtySize = PtySize(),
        user: Optional[str] = None,
        cwd: Optional[str] = None,
        envs: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
        request_timeout: Optional[float] = None,
        *,
        cmd: Union[str, Sequence[str], None] = None,
        on_data: Optional[Callback] = None,
    ) -> AsyncCommandHandle:
        """Start a shell (or ``cmd``) under a pseudo-terminal; returns its handle.

        Terminal output arrives as ``pty`` bytes (``on_data``, or
        ``handle.wait(on_pty=...)``, or iteration); type into it with
        :meth:`send_stdin`. ``timeout``: seconds, none by default.
        """
        env = {"TERM": "xterm-256color"}
        env.update(envs or {})
        args = argv(cmd) if cmd is not None else ["sh", "-i"]
        body = exec_body(self._sb.sandbox_id, args, envs=env, cwd=cwd, stdin_open=True, timeout=timeout, pty=size, user=user)
        return await self._sb.commands._exec(body, background=True, check=False, on_pty=on_data, request_timeout=request_timeout, pty=True)

    async def send_stdin(self, pid: Union[str, int], data: Union[str, bytes], request_timeout: Optional[float] = None) -> None:
        """Type into a terminal (``pid`` is the handle's ``id``)."""
        await self._sb.commands.send_stdin(pid, data, request_timeout=request_timeout)

    async def resize(self, pid: Union[str, int], size: PtySize, request_timeout: Optional[float] = None) -> None:
        """Change a terminal's size."""
        await self._sb.commands._resize(pid, size)

    async def kill(self, pid: Union[str, int], request_timeout: Optional[float] = None) -> bool:
        """Kill a terminal's process group."""
        return await self._sb.commands.kill(pid, request_timeout=request_timeout)
