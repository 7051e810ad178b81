"""Files in a sandbox (asyncio API)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Optional, Union

from .._concurrency import AsyncAbort, AsyncCancelled, AsyncCondition, AsyncEvent, AsyncWorker, AsyncWriteData, async_body, async_callback, async_to_thread
from .._protocol import FILE_CHUNK, check_path, file_mode
from ..exceptions import AlreadyExists, InvalidArgument, NotFound, SandboxNotFound, ShoalError, Timeout
from ..models import EntryInfo, FilesystemEvent, WriteInfo
from .commands import Callback

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox

class AsyncFiles:
    """``sb.files``: read, write, list and watch files in the sandbox (E2B's
    ``Filesystem``). Paths are absolute and must not contain ``..``."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._sb = sandbox

    @property
    def _t(self):  # type: ignore[no-untyped-def]
        return self._sb._transport

    async def _call(self, method: str, body: Dict[str, Any], request_timeout: Optional[float], idempotent: bool = True, user: Optional[str] = None) -> Dict[str, Any]:
        body = dict(body, sandboxId=self._sb.sandbox_id)
        if user:
            body["user"] = user
        return await self._t.call("SandboxService", method, body, idempotent=idempotent, request_timeout=request_timeout)

    # --- reading ---

    async def read(self, path: str, format: str = "text", user: Optional[str] = None, request_timeout: Optional[float] = None) -> Any:
        """Read a file.

        :param format: ``"text"`` (str, UTF-8), ``"bytes"``, or ``"stream"``
            (an iterator of byte chunks: large files never sit in memory;
            consume it fully or ``aclose()`` it).
        """
        check_path(path)
        if format == "stream":
            return await self._stream(path, request_timeout, user)
        if format not in ("text", "bytes"):
            raise InvalidArgument(f"format {format!r} must be 'text', 'bytes' or 'stream'")
        async with self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user) as r:
            data = await r.aread()
        return data.decode("utf-8", errors="replace") if format == "text" else data

    async def _stream(self, path: str, request_timeout: Optional[float], user: Optional[str] = None) -> AsyncIterator[bytes]:
        cm = self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user)
        resp = await cm.__aenter__()  # errors (not found, ...) surface here, not at the first chunk

        async def gen() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_bytes(FILE_CHUNK):
                    yield chunk
            except BaseException as e:
                if not await cm.__aexit__(type(e), e, e.__traceback__):
                    raise
            else:
                await cm.__aexit__(None, None, None)

        return gen()

    async def download(self, path: str, local_path: Union[str, "os.PathLike[str]"], request_timeout: Optional[float] = None, *, user: Optional[str] = None) -> int:
        """Stream a sandbox file to a local file; returns the number of bytes."""
        check_path(path)
        n = 0
        tmp = f"{os.fspath(local_path)}.shoal-part"
        try:
            async with self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user) as r:
                f = await async_to_thread(open, tmp, "wb")  # file work in a thread: a slow disk does not stall the loop
                try:
                    async for chunk in r.aiter_bytes(FILE_CHUNK):
                        await async_to_thread(f.write, chunk)
                        n += len(chunk)
                finally:
                    await async_to_thread(f.close)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return n

    # --- writing ---

    async def write(
        self,
        path: str,
        data: AsyncWriteData,
        user: Optional[str] = None,
        request_timeout: Optional[float] = None,
        *,
        mode: Optional[int] = None,
    ) -> WriteInfo:
        """Write a file atomically (parents are created; the old file stays
        until the new one is complete).

        :param data: ``str`` (UTF-8), ``bytes``, a file object or an iterable
            of byte chunks, or with asyncio an async iterable (streamed: sizes
            are not limited by memory).
        :param mode: permission bits (default ``0o644``).
        """
        check_path(path)
        r = await self._t.put_file(self._sb.sandbox_id, path, async_body(data, FILE_CHUNK), mode=file_mode(mode), request_timeout=request_timeout, user=user)
        return WriteInfo(name=os.path.basename(path), path=r.get("path", path), bytes=int(r.get("bytes") or 0))

    async def write_files(self, files: List[Dict[str, Any]], user: Optional[str] = None, request_timeout: Optional[float] = None) -> List[WriteInfo]:
        """Write several files: ``[{"path": ..., "data": ..., "mode": 0o755?}, ...]``."""
        return [await self.write(f["path"], f["data"], user=user, request_timeout=request_timeout, mode=f.get("mode")) for f in files]

    async def upload(
        self,
        local_path: Union[str, "os.PathLike[str]"],
        path: str,
        request_timeout: Optional[float] = None,
        *,
        mode: Optional[int] = None,
        user: Optional[str] = None,
    ) -> WriteInfo:
        """Stream a local file into the sandbox (mode defaults to the local file's)."""
        if mode is None:
            mode = os.stat(local_path).st_mode & 0o7777
        f = await async_to_thread(open, local_path, "rb")
        try:
            return await self.write(path, f, user=user, request_timeout=request_timeout, mode=mode)
        finally:
            f.close()

    # --- metadata ---

    async def get_info(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> EntryInfo:
        """Stat a path (symlinks are not followed)."""
        return EntryInfo.from_json(await self._call("StatFile", {"path": check_path(path)}, request_timeout, user=user))

    async def exists(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        """Whether the path exists (a missing sandbox still raises SandboxNotFound)."""
        try:
            await self.get_info(path, user=user, request_timeout=request_timeout)
            return True
        except SandboxNotFound:
            raise
        except NotFound:
            return False

    async def list(self, path: str, depth: int = 1, user: Optional[str] = None, request_timeout: Optional[float] = None) -> List[EntryInfo]:
        """A directory's entries; ``depth=n`` also lists ``n-1`` levels below."""
        if depth < 1:
            raise InvalidArgument("depth must be at least 1")
        body: Dict[str, Any] = {"path": check_path(path)}
        if depth > 1:
            body["depth"] = depth
        r = await self._call("ListDir", body, request_timeout, user=user)
        return [EntryInfo.from_json(e) for e in r.get("entries") or []]

    async def make_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        """Create a directory and its parents. False if it already existed."""
        try:
            if (await self.get_info(path, user=user, request_timeout=request_timeout)).is_dir:
                return False
            raise AlreadyExists(f"{path} exists and is not a directory")
        except SandboxNotFound:
            raise
        except NotFound:
            pass
        await self._call("MakeDir", {"path": path}, request_timeout, user=user)
        return True

    async def remove(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None, *, recursive: bool = True) -> None:
        """Remove a file or a directory (with its contents unless ``recursive=False``)."""
        await self._call("RemoveFile", {"path": check_path(path), "recursive": recursive}, request_timeout, user=user)

    async def rename(self, old_path: str, new_path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> EntryInfo:
        """Rename (move) a path; runs ``mv`` in the sandbox (there is no rename call yet)."""
        check_path(old_path)
        check_path(new_path)
        await self._sb.commands.run(["mv", "--", old_path, new_path], user=user, timeout=request_timeout or 60, request_timeout=request_timeout)
        return await self.get_info(new_path, user=user, request_timeout=request_timeout)

    # --- watching ---

    async def watch_dir(
        self,
        path: str,
        on_event: Optional[Callback] = None,
        on_exit: Optional[Callback] = None,
        recursive: bool = False,
        user: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> "AsyncWatchHandle":
        """Watch a directory for changes (inotify in the sandbox), armed with
        ``user``'s permissions if given (default root).

        Events are collected in the background: poll them with
        ``handle.get_new_events()`` (E2B), iterate over the handle
        (``async for``), or pass ``on_event`` (with asyncio, a function or a
        coroutine function). ``await handle.stop()`` ends the watch.
        """
        check_path(path)
        h = AsyncWatchHandle(self, path, recursive, on_event, on_exit, request_timeout, user)
        await h._start()
        return h

    watch = watch_dir


def _armed(ready: Any) -> Callable[[Any], None]:
    """on_open for WatchDir: the server sends its reply headers with
    "Shoal-Watch-Armed: 1" once the watch is armed (an error reply has
    headers too, without it). Closes over the event alone, not the handle,
    so the stream's generator and the handle form no reference cycle."""

    def on_open(headers: Any) -> None:
        if headers.get("shoal-watch-armed") == "1":
            ready.set()

    return on_open


class AsyncWatchHandle:
    """A running directory watch (E2B's ``AsyncWatchHandle``)."""

    def __init__(
        self,
        files: AsyncFiles,
        path: str,
        recursive: bool,
        on_event: Optional[Callback],
        on_exit: Optional[Callback],
        request_timeout: Optional[float],
        user: Optional[str] = None,
    ) -> None:
        self._path = path
        self._on_event = on_event
        self._on_exit = on_exit
        self._cond = AsyncCondition()
        self._events: List[FilesystemEvent] = []
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._finished = False
        self._abort = AsyncAbort()
        self._ready = AsyncEvent()
        self._stream = files._t.stream(
            "SandboxService",
            "WatchDir",
            dict({"sandboxId": files._sb.sandbox_id, "path": path, "recursive": recursive}, **({"user": user} if user else {})),
            idempotent=True,
            request_timeout=request_timeout,
            on_open=_armed(self._ready),
            abort=self._abort,
        )
        self._worker: Optional[AsyncWorker] = None
        self._ready_wait = request_timeout or files._t.config.request_timeout

    async def _start(self) -> None:
        self._worker = AsyncWorker(self._run, f"shoal-watch-{self._path}")
        # Return once the watch is armed (the server sends its reply headers
        # then), so a change made right after is reported; or once it failed.
        await self._ready.wait(self._ready_wait)
        with self._cond.critical():
            if self._error is not None and not self._events:
                raise self._error

    async def _run(self) -> None:
        err: Optional[BaseException] = None
        try:
            async for msg in self._stream:
                self._ready.set()
                if not msg.get("op") or msg.get("op") == "OP_UNSPECIFIED":
                    continue  # the server saying the watch is armed
                ev = FilesystemEvent.from_json(msg, self._path)
                async with self._cond:
                    self._events.append(ev)
                    self._cond.notify_all()
                await async_callback(self._on_event, ev)
        except AsyncCancelled:
            pass
        except BaseException as e:
            if not self._stopped:
                err = e
        finally:
            async with self._cond:
                self._error = err
                self._finished = True
                self._cond.notify_all()
            self._ready.set()
            await async_callback(self._on_exit, err if isinstance(err, Exception) else None)

    def get_new_events(self) -> List[FilesystemEvent]:
        """Events since the last call (E2B's polling interface)."""
        with self._cond.critical():
            if self._error is not None and not self._events:
                raise self._error
            out, self._events = self._events, []
            return out

    async def wait_for(self, predicate: Callable[[FilesystemEvent], bool], timeout: float = 10.0) -> FilesystemEvent:
        """Wait until an event matching ``predicate`` arrives (consuming events before it)."""
        deadline = time.monotonic() + timeout
        async with self._cond:
            while True:
                while self._events:
                    ev = self._events.pop(0)
                    if predicate(ev):
                        return ev
                if self._error is not None:
                    raise self._error
                if self._finished:
                    raise ShoalError("watch ended before a matching event")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(f"no matching event under {self._path} within {timeout} s")
                await self._cond.wait(left)

    def __aiter__(self) -> AsyncIterator[FilesystemEvent]:
        """Yield events as they arrive until :meth:`stop`."""
        return self._iter()

    async def _iter(self) -> AsyncIterator[FilesystemEvent]:
        while True:
            async with self._cond:
                while not self._events and not self._finished:
                    await self._cond.wait()
                if self._events:
                    ev = self._events.pop(0)
                else:
                    if self._error is not None:
                        raise self._error
                    return
            yield ev

    async def stop(self) -> None:
        """End the watch."""
        self._stopped = True
        self._abort()
        if self._worker is not None:
            await self._worker.stop()

    async def __aenter__(self) -> "AsyncWatchHandle":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
