"""Blocking HTTP transport: unary Connect calls, server streams and the
streamed file endpoints, with retries for idempotent calls."""

from __future__ import annotations

import inspect
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple, Union
from urllib.parse import urlsplit

import httpx

from .._config import VERSION, ConnectionConfig
from .._protocol import (
    EnvelopeDecoder,
    StreamEnd,
    backoff,
    decode_message,
    decode_ndjson,
    metadata_reason,
    envelope,
    http_error,
    retry_after,
    retryable,
    transport_error,
)
from ..exceptions import ConnectionLost, ShoalError

_LOOPBACK = ("127.", "localhost", "[::1]", "::1")


def _nodelay_transport(limits: httpx.Limits, trust_env: bool, verify: Any = True) -> httpx.HTTPTransport:
    """An httpx transport whose sockets have TCP_NODELAY.

    httpx's blocking transport (httpcore 0.16) leaves Nagle's algorithm on:
    a request's body then waits for the ACK of its headers, which the
    server delays by ~40 ms, so every call with a body took ~44 ms instead of
    ~1 ms. (The asyncio transport, on anyio, sets TCP_NODELAY itself.)
    """
    opt = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    if "socket_options" in inspect.signature(httpx.HTTPTransport).parameters:  # httpx >= 0.24
        return httpx.HTTPTransport(limits=limits, trust_env=trust_env, verify=verify, socket_options=opt)  # type: ignore[call-arg]
    t = httpx.HTTPTransport(limits=limits, trust_env=trust_env, verify=verify)
    try:
        from httpcore.backends.sync import SyncBackend  # httpcore 0.16 (Debian 12)

        class NoDelayBackend(SyncBackend):  # type: ignore[misc]
            def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
                stream = super().connect_tcp(*args, **kwargs)
                sock = stream.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(*opt[0])
                return stream

        pool = getattr(t, "_pool", None)
        if pool is not None and hasattr(pool, "_network_backend"):
            pool._network_backend = NoDelayBackend()
    except Exception:  # another httpcore: keep its defaults
        pass
    return t


def _client_kwargs(config: ConnectionConfig) -> Dict[str, Any]:
    headers = {"User-Agent": f"shoal-python/{VERSION}"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    host = urlsplit(config.url).hostname or ""
    return dict(
        base_url=config.url,
        headers=headers,
        timeout=httpx.Timeout(config.request_timeout, connect=min(10.0, config.request_timeout)),
        # httpcore checks every idle pooled connection (a poll(2) each) on
        # every request: after a burst of creates, hundreds of idle
        # connections cost ~2 ms of CPU per call. Keep few, briefly.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=16, keepalive_expiry=5.0),
        # Like Go's ProxyFromEnvironment: never send a local server through a proxy.
        trust_env=not host.startswith(_LOOPBACK),
        verify=config.ssl_context(),
    )


def _port_client_kwargs(config: ConnectionConfig, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """_client_kwargs for a client of a sandbox's port (``http_client``):
    the key as X-API-Key, so that an Authorization header is the app's,
    and the caller's ``headers`` merged in; the rest of ``kwargs`` is the
    caller's to apply."""
    kw = _client_kwargs(config)
    if "Authorization" in kw["headers"]:
        kw["headers"]["X-API-Key"] = kw["headers"].pop("Authorization").removeprefix("Bearer ")
    kw["headers"].update(kwargs.pop("headers", None) or {})
    return kw


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


def _rpc_path(service: str, method: str) -> str:
    return f"/shoal.v1.{service}/{method}"


class Transport:
    """One connection pool to one Shoal endpoint; safe to share between threads."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config
        kw = _client_kwargs(config)
        kw["transport"] = _nodelay_transport(kw.pop("limits"), kw["trust_env"], kw["verify"])
        self.client = httpx.Client(**kw)

    def close(self) -> None:
        self.client.close()

    def _timeout(self, request_timeout: Optional[float]) -> Union[float, httpx.Timeout]:
        if request_timeout is None:
            return self.client.timeout
        return httpx.Timeout(request_timeout, connect=min(10.0, request_timeout))

    def _retrying(self, attempt_fn: Callable[[], Any], idempotent: bool) -> Any:
        attempt = 0
        while True:
            try:
                return attempt_fn()
            except (httpx.TransportError, ShoalError) as e:
                if attempt >= self.config.retries or not retryable(e, idempotent):
                    if isinstance(e, httpx.TransportError):
                        raise transport_error(e, self.config.url) from None
                    raise
                time.sleep(backoff(attempt, getattr(e, "retry_after", None)))
                attempt += 1

    # --- unary ---

    def call(
        self,
        service: str,
        method: str,
        body: Mapping[str, Any],
        *,
        idempotent: bool,
        request_timeout: Optional[float] = None,
        sandbox_call: bool = False,
        trajectory: bool = False,
    ) -> Dict[str, Any]:
        """POST one Connect unary call as JSON and return the reply."""
        path = _rpc_path(service, method)

        def attempt() -> Dict[str, Any]:
            r = self.client.post(
                path,
                json=body,
                headers={"Connect-Protocol-Version": "1"},
                timeout=self._timeout(request_timeout),
            )
            if r.status_code != 200:
                err = http_error(
                    r.status_code,
                    r.content,
                    what=f"{service}.{method}",
                    sandbox_call=sandbox_call,
                    trajectory=trajectory,
                    reason=metadata_reason(r.headers),
                )
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r.json() if r.content else {}

        return self._retrying(attempt, idempotent)

    # --- server streams ---

    def stream(
        self,
        service: str,
        method: str,
        body: Mapping[str, Any],
        *,
        idempotent: bool,
        request_timeout: Optional[float] = None,
        read_timeout: Optional[float] = None,
        sandbox_call: bool = False,
        trajectory: bool = False,
        on_open: Optional[Callable[[httpx.Headers], None]] = None,
        abort: Optional["Abort"] = None,
    ) -> Iterator[Dict[str, Any]]:
        """Messages of a server-streaming call, until the server ends it.

        A failure before the first message is retried like a unary call; a
        connection lost after it raises ConnectionLost (the caller knows
        whether and how to resume). ``on_open`` gets the reply headers once
        they arrived; ``abort`` lets another thread cut the stream.
        """
        path = _rpc_path(service, method)
        rt = request_timeout if request_timeout is not None else self.config.request_timeout
        timeout = httpx.Timeout(connect=min(10.0, rt), read=read_timeout, write=rt, pool=rt)
        content = envelope(body)
        attempt = 0
        while True:
            yielded = False
            try:
                req = self.client.build_request(
                    "POST",
                    path,
                    content=content,
                    headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
                    timeout=timeout,
                )
                resp = self.client.send(req, stream=True)
                try:
                    if abort is not None:
                        abort.bind(resp.close)
                    if resp.status_code != 200:
                        resp.read()
                        err = http_error(
                    resp.status_code,
                    resp.content,
                    what=f"{service}.{method}",
                    sandbox_call=sandbox_call,
                    trajectory=trajectory,
                    reason=metadata_reason(resp.headers),
                )
                        err.retry_after = retry_after(resp)  # type: ignore[attr-defined]
                        raise err
                    if on_open is not None:
                        on_open(resp.headers)
                        on_open = None
                    dec = EnvelopeDecoder()
                    ended = False
                    for chunk in resp.iter_raw():
                        if ended:
                            continue  # read the body to its end, so the connection is reused
                        for flags, payload in dec.feed(chunk):
                            try:
                                msg = decode_message(flags, payload, sandbox_call=sandbox_call, trajectory=trajectory)
                            except StreamEnd:
                                ended = True
                                break
                            yielded = True
                            yield msg
                    if ended:
                        return
                    raise ConnectionLost(f"{service}.{method} stream from {self.config.url} ended without its end-of-stream message")
                finally:
                    resp.close()
            except (httpx.TransportError, ShoalError) as e:
                if yielded:
                    if isinstance(e, httpx.TransportError):
                        raise ConnectionLost(f"{service}.{method} stream from {self.config.url} broke: {type(e).__name__}: {e}") from None
                    raise
                if attempt >= self.config.retries or not retryable(e, idempotent):
                    if isinstance(e, httpx.TransportError):
                        raise transport_error(e, self.config.url) from None
                    raise
                time.sleep(backoff(attempt, getattr(e, "retry_after", None)))
                attempt += 1

    # --- plain HTTP endpoints (layer images) ---

    @contextmanager
    def get_stream(
        self, url: str, params: Mapping[str, str], *, what: str, request_timeout: Optional[float] = None
    ) -> Iterator[httpx.Response]:
        """The streamed reply of a GET (status checked; retried until it starts)."""

        def attempt() -> httpx.Response:
            r = self.client.send(self.client.build_request("GET", url, params=params, timeout=self._timeout(request_timeout)), stream=True)
            if r.status_code != 200:
                r.read()
                r.close()
                err = http_error(r.status_code, r.content, what=what)
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r

        resp = self._retrying(attempt, True)
        try:
            yield resp
        except httpx.TransportError as e:
            raise ConnectionLost(f"{what} broke: {type(e).__name__}: {e}") from None
        finally:
            resp.close()

    def send_body(
        self,
        method: str,
        url: str,
        params: Mapping[str, str],
        content: Callable[[], Union[bytes, Iterator[bytes]]],
        *,
        what: str,
        idempotent: bool,
        content_type: str = "application/octet-stream",
        request_timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Send a body (made afresh by ``content()`` for each attempt) and
        return the JSON reply. Retried only when ``idempotent``."""

        def attempt() -> Dict[str, Any]:
            body = content()
            try:
                r = self.client.request(
                    method,
                    url,
                    params=params,
                    content=body,
                    headers={"Content-Type": content_type},
                    timeout=self._timeout(request_timeout),
                )
            finally:
                close = getattr(body, "close", None)  # a generator holding a file
                if close is not None:
                    close()
            if r.status_code != 200:
                err = http_error(r.status_code, r.content, what=what)
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r.json() if r.content else {}

        return self._retrying(attempt, idempotent)

    def post_ndjson(
        self,
        url: str,
        params: Mapping[str, str],
        content: Iterator[bytes],
        *,
        what: str,
        content_type: str = "application/octet-stream",
        request_timeout: Optional[float] = None,
    ) -> Iterator[Dict[str, Any]]:
        """POST a streamed body (sent once: not retried) and yield the
        messages of the NDJSON reply; an error line raises."""
        try:
            try:
                resp = self.client.send(
                    self.client.build_request("POST", url, params=params, content=content, headers={"Content-Type": content_type}, timeout=self._timeout(request_timeout)),
                    stream=True,
                )
            except httpx.WriteError as e:
                # The server stopped reading the body: it answers a source
                # over its --build-upload-max so, when the client sends on.
                raise ConnectionLost(
                    f"{what}: the server stopped reading the upload ({type(e).__name__}: {e}): it refuses sources larger than its --build-upload-max, or it went away"
                ) from None
            except httpx.TransportError as e:
                raise transport_error(e, self.config.url) from None
        finally:
            close = getattr(content, "close", None)  # the server may answer before the body is sent
            if close is not None:
                close()
        try:
            if resp.status_code != 200:
                resp.read()
                raise http_error(resp.status_code, resp.content, what=what)
            for line in resp.iter_lines():
                if line.strip():
                    yield decode_ndjson(line)
        except httpx.TransportError as e:
            raise ConnectionLost(f"{what} broke: {type(e).__name__}: {e}") from None
        finally:
            resp.close()

    # --- file bytes ---

    def _file_url(self, sandbox_id: str, path: str, mode: Optional[str] = None, user: Optional[str] = None) -> Tuple[str, Dict[str, str]]:
        params = {"path": path}
        if mode is not None:
            params["mode"] = mode
        if user:
            params["user"] = user
        return f"/v1/sandboxes/{sandbox_id}/files", params

    @contextmanager
    def get_file(self, sandbox_id: str, path: str, *, request_timeout: Optional[float] = None, user: Optional[str] = None) -> Iterator[httpx.Response]:
        """The streamed reply of GET /v1/sandboxes/{id}/files (status checked)."""
        url, params = self._file_url(sandbox_id, path, user=user)

        def attempt() -> httpx.Response:
            r = self.client.send(self.client.build_request("GET", url, params=params, timeout=self._timeout(request_timeout)), stream=True)
            if r.status_code != 200:
                r.read()
                r.close()
                err = http_error(r.status_code, r.content, what="file download")
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r

        resp = self._retrying(attempt, True)
        try:
            yield resp
        except httpx.TransportError as e:
            raise ConnectionLost(f"download of {path} broke: {type(e).__name__}: {e}") from None
        finally:
            resp.close()

    def put_file(
        self,
        sandbox_id: str,
        path: str,
        content: Union[bytes, Iterator[bytes]],
        *,
        mode: Optional[str],
        request_timeout: Optional[float] = None,
        user: Optional[str] = None,
    ) -> Dict[str, Any]:
        """PUT /v1/sandboxes/{id}/files: atomically replaces the file.

        Retried only when the body is bytes (it can be sent again)."""
        url, params = self._file_url(sandbox_id, path, mode, user)

        def attempt() -> Dict[str, Any]:
            r = self.client.put(
                url,
                params=params,
                content=content,
                headers={"Content-Type": "application/octet-stream"},
                timeout=self._timeout(request_timeout),
            )
            if r.status_code != 200:
                err = http_error(r.status_code, r.content, what="file upload")
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r.json() if r.content else {}

        return self._retrying(attempt, isinstance(content, bytes))


_pools: Dict[Tuple[Any, ...], Transport] = {}
_pools_lock = threading.Lock()


def transport_for(
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    retries: Optional[int] = None,
) -> Transport:
    """The shared transport for these settings (one connection pool each)."""
    config = ConnectionConfig.resolve(url=url, api_key=api_key, request_timeout=request_timeout, retries=retries)
    with _pools_lock:
        t = _pools.get(config.key)
        if t is None:
            t = _pools[config.key] = Transport(config)
        return t


def close_all() -> None:
    """Close every shared connection pool (they reopen on the next call)."""
    with _pools_lock:
        for t in _pools.values():
            t.close()
        _pools.clear()
