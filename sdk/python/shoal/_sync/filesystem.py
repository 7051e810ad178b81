"""Files in a sandbox (blocking API). See ``shoal._async.filesystem`` for
the asyncio twin."""

from __future__ import annotations

import os
import threading
from typing import IO, TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

from .._protocol import FILE_CHUNK, check_path, file_mode
from ..exceptions import AlreadyExists, InvalidArgument, NotFound, SandboxNotFound, ShoalError, Timeout
from ..models import EntryInfo, FilesystemEvent, WriteInfo
from .transport import Abort

if TYPE_CHECKING:
    from .sandbox import Sandbox

WriteData = Union[str, bytes, bytearray, memoryview, IO[bytes], IO[str], Iterable[bytes]]


def _body(data: WriteData) -> Union[bytes, Iterator[bytes]]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read"):
        return _read_chunks(data)  # type: ignore[arg-type]
    if hasattr(data, "__iter__"):
        return (b.encode() if isinstance(b, str) else bytes(b) for b in data)  # type: ignore[union-attr]
    raise InvalidArgument(f"data must be str, bytes, a file object or an iterable of bytes, not {type(data).__name__}")


def _read_chunks(f: IO[Any]) -> Iterator[bytes]:
    while True:
        b = f.read(FILE_CHUNK)
        if not b:
            return
        yield b.encode() if isinstance(b, str) else b


class Files:
    """``sb.files``: read, write, list and watch files in the sandbox (E2B's
    ``Filesystem``). Paths are absolute and must not contain ``..``."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sb = sandbox

    @property
    def _t(self):  # type: ignore[no-untyped-def]
        return self._sb._transport

    def _call(self, method: str, body: Dict[str, Any], request_timeout: Optional[float], idempotent: bool = True, user: Optional[str] = None) -> Dict[str, Any]:
        body = dict(body, sandboxId=self._sb.sandbox_id)
        if user:
            body["user"] = user
        return self._t.call("SandboxService", method, body, idempotent=idempotent, request_timeout=request_timeout)

    # --- reading ---

    def read(self, path: str, format: str = "text", user: Optional[str] = None, request_timeout: Optional[float] = None) -> Any:
        """Read a file.

        :param format: ``"text"`` (str, UTF-8), ``"bytes"``, or ``"stream"``
            (an iterator of byte chunks: large files never sit in memory;
            consume it fully or close it).
        """
        check_path(path)
        if format == "stream":
            return self._stream(path, request_timeout, user)
        if format not in ("text", "bytes"):
            raise InvalidArgument(f"format {format!r} must be 'text', 'bytes' or 'stream'")
        with self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user) as r:
            data = r.read()
        return data.decode("utf-8", errors="replace") if format == "text" else data

    def _stream(self, path: str, request_timeout: Optional[float], user: Optional[str] = None) -> Iterator[bytes]:
        cm = self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user)
        resp = cm.__enter__()  # errors (not found, ...) surface here, not at the first chunk

        def gen() -> Iterator[bytes]:
            try:
                for chunk in resp.iter_bytes(FILE_CHUNK):
                    yield chunk
            except BaseException as e:
                if not cm.__exit__(type(e), e, e.__traceback__):
                    raise
            else:
                cm.__exit__(None, None, None)

        return gen()

    def download(self, path: str, local_path: Union[str, "os.PathLike[str]"], request_timeout: Optional[float] = None, *, user: Optional[str] = None) -> int:
        """Stream a sandbox file to a local file; returns the number of bytes."""
        check_path(path)
        n = 0
        tmp = f"{os.fspath(local_path)}.shoal-part"
        try:
            with self._t.get_file(self._sb.sandbox_id, path, request_timeout=request_timeout, user=user) as r, open(tmp, "wb") as f:
                for chunk in r.iter_bytes(FILE_CHUNK):
                    f.write(chunk)
                    n += len(chunk)
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return n

    # --- writing ---

    def write(
        self,
        path: str,
        data: WriteData,
        user: Optional[str] = None,
        request_timeout: Optional[float] = None,
        *,
        mode: Optional[int] = None,
    ) -> WriteInfo:
        """Write a file atomically (parents are created; the old file stays
        until the new one is complete).

        :param data: ``str`` (UTF-8), ``bytes``, a file object or an iterable
            of byte chunks (streamed: sizes are not limited by memory).
        :param mode: permission bits (default ``0o644``).
        """
        check_path(path)
        r = self._t.put_file(self._sb.sandbox_id, path, _body(data), mode=file_mode(mode), request_timeout=request_timeout, user=user)
        return WriteInfo(name=os.path.basename(path), path=r.get("path", path), bytes=int(r.get("bytes") or 0))

    def write_files(self, files: List[Dict[str, Any]], user: Optional[str] = None, request_timeout: Optional[float] = None) -> List[WriteInfo]:
        """Write several files: ``[{"path": ..., "data": ..., "mode": 0o755?}, ...]``."""
        return [self.write(f["path"], f["data"], user=user, request_timeout=request_timeout, mode=f.get("mode")) for f in files]

    def upload(
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
        with open(local_path, "rb") as f:
            return self.write(path, f, user=user, request_timeout=request_timeout, mode=mode)

    # --- metadata ---

    def get_info(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> EntryInfo:
        """Stat a path (symlinks are not followed)."""
        return EntryInfo.from_json(self._call("StatFile", {"path": check_path(path)}, request_timeout, user=user))

    def exists(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        """Whether the path exists (a missing sandbox still raises SandboxNotFound)."""
        try:
            self.get_info(path, user=user, request_timeout=request_timeout)
            return True
        except SandboxNotFound:
            raise
        except NotFound:
            return False

    def list(self, path: str, depth: int = 1, user: Optional[str] = None, request_timeout: Optional[float] = None) -> List[EntryInfo]:
        """A directory's entries; ``depth=n`` also lists ``n-1`` levels below."""
        if depth < 1:
            raise InvalidArgument("depth must be at least 1")
        body: Dict[str, Any] = {"path": check_path(path)}
        if depth > 1:
            body["depth"] = depth
        r = self._call("ListDir", body, request_timeout, user=user)
        return [EntryInfo.from_json(e) for e in r.get("entries") or []]

    def make_dir(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> bool:
        """Create a directory and its parents. False if it already existed."""
        try:
            if self.get_info(path, user=user, request_timeout=request_timeout).is_dir:
                return False
            raise AlreadyExists(f"{path} exists and is not a directory")
        except SandboxNotFound:
            raise
        except NotFound:
            pass
        self._call("MakeDir", {"path": path}, request_timeout, user=user)
        return True

    def remove(self, path: str, user: Optional[str] = None, request_timeout: Optional[float] = None, *, recursive: bool = True) -> None:
        """Remove a file or a directory (with its contents unless ``recursive=False``)."""
        self._call("RemoveFile", {"path": check_path(path), "recursive": recursive}, request_timeout, user=user)

    def rename(self, old_path: str, new_path: str, user: Optional[str] = None, request_timeout: Optional[float] = None) -> EntryInfo:
        """Rename (move) a path; runs ``mv`` in the sandbox (there is no rename call yet)."""
        check_path(old_path)
        check_path(new_path)
        self._sb.commands.run(["mv", "--", old_path, new_path], user=user, timeout=request_timeout or 60, request_timeout=request_timeout)
        return self.get_info(new_path, user=user, request_timeout=request_timeout)

    # --- watching ---

    def watch_dir(
        self,
        path: str,
        on_event: Optional[Callable[[FilesystemEvent], Any]] = None,
        on_exit: Optional[Callable[[Optional[Exception]], Any]] = None,
        recursive: bool = False,
        user: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> "WatchHandle":
        """Watch a directory for changes (inotify in the sandbox), armed with
        ``user``'s permissions if given (default root).

        Events are collected in the background: poll them with
        ``handle.get_new_events()`` (E2B), iterate over the handle, or pass
        ``on_event``. ``handle.stop()`` ends the watch.
        """
        check_path(path)
        return WatchHandle(self, path, recursive, on_event, on_exit, request_timeout, user)

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


class WatchHandle:
    """A running directory watch (E2B's ``WatchHandle``)."""

    def __init__(
        self,
        files: Files,
        path: str,
        recursive: bool,
        on_event: Optional[Callable[[FilesystemEvent], Any]],
        on_exit: Optional[Callable[[Optional[Exception]], Any]],
        request_timeout: Optional[float],
        user: Optional[str] = None,
    ) -> None:
        self._path = path
        self._on_event = on_event
        self._on_exit = on_exit
        self._cond = threading.Condition()
        self._events: List[FilesystemEvent] = []
        self._error: Optional[BaseException] = None
        self._stopped = False
        self._finished = False
        self._abort = Abort()
        self._ready = threading.Event()
        self._stream = files._t.stream(
            "SandboxService",
            "WatchDir",
            dict({"sandboxId": files._sb.sandbox_id, "path": path, "recursive": recursive}, **({"user": user} if user else {})),
            idempotent=True,
            request_timeout=request_timeout,
            on_open=_armed(self._ready),
            abort=self._abort,
        )
        self._thread = threading.Thread(target=self._run, name=f"shoal-watch-{path}", daemon=True)
        self._thread.start()
        # Return once the watch is armed (the server sends its reply headers
        # then), so a change made right after is reported; or once it failed.
        self._ready.wait(request_timeout or files._t.config.request_timeout)
        with self._cond:
            if self._error is not None and not self._events:
                raise self._error

    def _run(self) -> None:
        err: Optional[BaseException] = None
        try:
            for msg in self._stream:
                self._ready.set()
                if not msg.get("op") or msg.get("op") == "OP_UNSPECIFIED":
                    continue  # the server saying the watch is armed
                ev = FilesystemEvent.from_json(msg, self._path)
                with self._cond:
                    self._events.append(ev)
                    self._cond.notify_all()
                if self._on_event:
                    self._on_event(ev)
        except BaseException as e:
            if not self._stopped:
                err = e
        finally:
            with self._cond:
                self._error = err
                self._finished = True
                self._cond.notify_all()
            self._ready.set()
            if self._on_exit:
                self._on_exit(err if isinstance(err, Exception) else None)

    def get_new_events(self) -> List[FilesystemEvent]:
        """Events since the last call (E2B's polling interface)."""
        with self._cond:
            if self._error is not None and not self._events:
                raise self._error
            out, self._events = self._events, []
            return out

    def wait_for(self, predicate: Callable[[FilesystemEvent], bool], timeout: float = 10.0) -> FilesystemEvent:
        """Block until an event matching ``predicate`` arrives (consuming events before it)."""
        import time

        deadline = time.monotonic() + timeout
        with self._cond:
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
                self._cond.wait(left)

    def __iter__(self) -> Iterator[FilesystemEvent]:
        """Yield events as they arrive until :meth:`stop`."""
        while True:
            with self._cond:
                while not self._events and not self._finished:
                    self._cond.wait()
                if self._events:
                    ev = self._events.pop(0)
                else:
                    if self._error is not None:
                        raise self._error
                    return
            yield ev

    def stop(self) -> None:
        """End the watch."""
        self._stopped = True
        self._abort()
        self._thread.join(timeout=5)

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
