"""What the asyncio client and the blocking client do differently, in pairs.

The blocking client (``shoal._sync``) is generated from the asyncio one
(``shoal._async``) by ``scripts/unasync.py``, which drops ``async``/``await``
and maps every name here that starts with ``Async``/``async_`` onto its twin
without the prefix. What differs in kind, not only by ``await`` (a task or a
thread, asyncio's primitives or threading's, reading a file in a thread or
not), is written here twice, side by side; the rest is written once.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from typing import IO, Any, AsyncIterable, AsyncIterator, Callable, Dict, Generic, Iterable, Iterator, Optional, Tuple, TypeVar, Union

from ._protocol import chunks
from .exceptions import InvalidArgument

T = TypeVar("T")

# --- pauses, blocking work, callbacks ---


async def async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


async def async_to_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work (a file read) in a thread, so the loop goes on."""
    return await asyncio.to_thread(fn, *args)


def to_thread(fn: Callable[..., T], *args: Any) -> T:
    return fn(*args)


async def async_callback(cb: Optional[Callable[[Any], Any]], arg: Any) -> None:
    """Call a user's callback: a function or a coroutine function."""
    if cb is not None:
        r = cb(arg)
        if inspect.isawaitable(r):
            await r


def callback(cb: Optional[Callable[[Any], Any]], arg: Any) -> None:
    if cb is not None:
        cb(arg)


# A task is cancelled (asyncio.CancelledError); a thread never is.
AsyncCancelled = asyncio.CancelledError


class Cancelled(BaseException):
    """Never raised: a thread is not cancelled, its stream is cut (Abort)."""


# --- primitives ---


class AsyncLock:
    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> None:
        await self._lock.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self._lock.release()


class Lock:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


class AsyncEvent:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until it is set or ``timeout`` seconds passed; whether it is set."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return self._event.is_set()


class Event:
    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._event.wait(timeout)


class AsyncCondition:
    """``async with cond:`` around changes and waits; ``with cond.critical():``
    around a read with no ``await`` in it (nothing to take in asyncio: the
    loop runs one task at a time)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()

    async def __aenter__(self) -> None:
        await self._cond.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self._cond.release()

    @contextmanager
    def critical(self) -> Iterator[None]:
        yield

    def notify_all(self) -> None:
        self._cond.notify_all()

    async def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for a notify, or ``timeout`` seconds (held on return)."""
        try:
            await asyncio.wait_for(self._cond.wait(), timeout)
        except asyncio.TimeoutError:
            pass


class Condition:
    def __init__(self) -> None:
        self._cond = threading.Condition()

    def __enter__(self) -> None:
        self._cond.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._cond.release()

    def critical(self) -> "threading.Condition":
        return self._cond

    def notify_all(self) -> None:
        self._cond.notify_all()

    def wait(self, timeout: Optional[float] = None) -> None:
        self._cond.wait(timeout)


class QueueTimeout(Exception):
    """``get(timeout)`` found nothing in time."""


class AsyncQueue(Generic[T]):
    """Unbounded: ``put`` never waits."""

    def __init__(self) -> None:
        self._q: "asyncio.Queue[T]" = asyncio.Queue()

    def put(self, item: T) -> None:
        self._q.put_nowait(item)

    async def get(self, timeout: Optional[float] = None) -> T:
        try:
            return await asyncio.wait_for(self._q.get(), timeout)
        except asyncio.TimeoutError:
            raise QueueTimeout() from None


class Queue(Generic[T]):
    def __init__(self) -> None:
        self._q: "queue.Queue[T]" = queue.Queue()

    def put(self, item: T) -> None:
        self._q.put(item)

    def get(self, timeout: Optional[float] = None) -> T:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            raise QueueTimeout() from None


# --- background work ---

_running: "set[asyncio.Task[None]]" = set()  # a reference to each task until it is done


class AsyncWorker:
    """``fn()`` run as a task of the running loop; ``stop()`` cancels it."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(fn), name=name)
        _running.add(self._task)
        self._task.add_done_callback(_running.discard)

    @staticmethod
    async def _run(fn: Callable[[], Any]) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            pass

    async def stop(self) -> None:
        if self._task is asyncio.current_task():
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class Worker:
    """``fn()`` run in a daemon thread. A thread cannot be cancelled:
    ``stop()`` waits (up to 5 s) for it to end, once the caller cut its
    stream (:class:`Abort`)."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._thread = threading.Thread(target=fn, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not threading.current_thread():  # stopped from one of its callbacks
            self._thread.join(timeout=5)


class AsyncAbort:
    """The asyncio twin of :class:`Abort`: nothing to cut from elsewhere,
    the task reading a stream is cancelled instead."""

    def __init__(self) -> None:
        self.aborted = False

    def bind(self, close: Callable[[], Any]) -> None:
        pass

    def __call__(self) -> None:
        self.aborted = True

    def cut(self) -> None:
        pass


class Abort:
    """Cuts a stream from another thread (closes its HTTP response).

    It holds no reference to the stream's generator, so a reader keeping
    both forms no reference cycle: a cycle leaves the generator's clean-up to
    the garbage collector, which may run it on any thread, even one that
    holds httpcore's (non-reentrant) connection pool lock: a deadlock.
    """

    def __init__(self) -> None:
        self._close: Optional[Callable[[], None]] = None
        self.aborted = False

    def bind(self, close: Callable[[], None]) -> None:
        self._close = close
        if self.aborted:
            close()

    def __call__(self) -> None:
        """Cut the stream for good (a stream opened later is cut at once)."""
        self.aborted = True
        self.cut()

    def cut(self) -> None:
        """Cut the current connection only, as a network failure would."""
        close = self._close
        if close is not None:
            try:
                close()
            except Exception:
                pass


# --- shared connection pools ---


class AsyncPools(Generic[T]):
    """One pool per event loop and settings: an httpx.AsyncClient must not be
    shared between loops (each asyncio.run() makes a new one)."""

    def __init__(self) -> None:
        self._pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Dict[Tuple[Any, ...], T]]" = weakref.WeakKeyDictionary()

    def get(self, key: Tuple[Any, ...], make: Callable[[], T]) -> T:
        """The running loop's pool for ``key``, made on first use."""
        loop = asyncio.get_running_loop()
        per_loop = self._pools.setdefault(loop, {})
        t = per_loop.get(key)
        if t is None:
            t = per_loop[key] = make()
            # Close the pool when the loop shuts down (asyncio.run() closes the
            # async generators still alive), so sockets are not left to the GC.
            closer = _close_at_shutdown(t)
            t._closer = closer  # type: ignore[attr-defined]
            loop.create_task(closer.__anext__())  # type: ignore[arg-type]
        return t

    async def aclose(self) -> None:
        """Close the running loop's pools (they reopen on the next call)."""
        for t in self._pools.pop(asyncio.get_running_loop(), {}).values():
            await t.aclose()  # type: ignore[attr-defined]


async def _close_at_shutdown(t: Any) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await t.aclose()


class Pools(Generic[T]):
    """One pool per settings, shared by all threads."""

    def __init__(self) -> None:
        self._pools: Dict[Tuple[Any, ...], T] = {}
        self._lock = threading.Lock()

    def get(self, key: Tuple[Any, ...], make: Callable[[], T]) -> T:
        with self._lock:
            t = self._pools.get(key)
            if t is None:
                t = self._pools[key] = make()
            return t

    def close(self) -> None:
        """Close every pool (they reopen on the next call)."""
        with self._lock:
            for t in self._pools.values():
                t.close()  # type: ignore[attr-defined]
            self._pools.clear()


# --- data to send: str, bytes, file objects, (async) iterables ---

AsyncWriteData = Union[str, bytes, bytearray, memoryview, IO[bytes], IO[str], Iterable[bytes], AsyncIterable[bytes]]
WriteData = Union[str, bytes, bytearray, memoryview, IO[bytes], IO[str], Iterable[bytes]]


def async_body(data: AsyncWriteData, chunk: int) -> Union[bytes, AsyncIterator[bytes]]:
    """A request body: bytes, or chunks streamed from a file or an iterable."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read") or hasattr(data, "__aiter__") or hasattr(data, "__iter__"):
        return async_iter_chunks(data, chunk)
    raise InvalidArgument(f"data must be str, bytes, a file object or an iterable of bytes, not {type(data).__name__}")


def body(data: WriteData, chunk: int) -> Union[bytes, Iterator[bytes]]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "read") or hasattr(data, "__iter__"):
        return iter_chunks(data, chunk)
    raise InvalidArgument(f"data must be str, bytes, a file object or an iterable of bytes, not {type(data).__name__}")


async def async_iter_chunks(source: Any, chunk: int) -> AsyncIterator[bytes]:
    """Bytes of ``source`` (bytes, an async iterable, a file object read in
    a thread, or an iterable) in pieces; str pieces are UTF-8 encoded."""
    if isinstance(source, (bytes, bytearray)):
        for c in chunks(bytes(source), chunk):
            yield c
    elif hasattr(source, "__aiter__"):
        async for b in source:
            yield b.encode() if isinstance(b, str) else bytes(b)
    elif hasattr(source, "read"):
        while True:
            b = await asyncio.to_thread(source.read, chunk)  # a slow disk does not stall the loop
            if not b:
                return
            yield b.encode() if isinstance(b, str) else b
    else:
        for b in source:
            yield b.encode() if isinstance(b, str) else bytes(b)


def iter_chunks(source: Any, chunk: int) -> Iterator[bytes]:
    if isinstance(source, (bytes, bytearray)):
        yield from chunks(bytes(source), chunk)
    elif hasattr(source, "read"):
        while True:
            b = source.read(chunk)
            if not b:
                return
            yield b.encode() if isinstance(b, str) else b
    else:
        for b in source:
            yield b.encode() if isinstance(b, str) else bytes(b)
