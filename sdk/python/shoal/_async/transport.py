"""HTTP transport (asyncio API): unary Connect calls, server streams and the
streamed file endpoints, with retries for idempotent calls."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Mapping, Optional, Tuple, Union

import httpx

from .._config import ConnectionConfig
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
from .._concurrency import AsyncAbort, AsyncPools, async_sleep
from .._http import _client_kwargs, _rpc_path, async_pool_client
from ..exceptions import ConnectionLost, ShoalError


class AsyncTransport:
    """One connection pool to one Shoal endpoint. The asyncio one is bound to
    one event loop; the blocking one is safe to share between threads."""

    def __init__(self, config: ConnectionConfig) -> None:
        self.config = config
        self.client = async_pool_client(_client_kwargs(config))

    async def aclose(self) -> None:
        await self.client.aclose()

    def _timeout(self, request_timeout: Optional[float]) -> Union[float, httpx.Timeout]:
        if request_timeout is None:
            return self.client.timeout
        return httpx.Timeout(request_timeout, connect=min(10.0, request_timeout))

    async def _retrying(self, attempt_fn: Callable[[], Awaitable[Any]], idempotent: bool) -> Any:
        attempt = 0
        while True:
            try:
                return await attempt_fn()
            except (httpx.TransportError, ShoalError) as e:
                if attempt >= self.config.retries or not retryable(e, idempotent):
                    if isinstance(e, httpx.TransportError):
                        raise transport_error(e, self.config.url) from None
                    raise
                await async_sleep(backoff(attempt, getattr(e, "retry_after", None)))
                attempt += 1

    # --- unary ---

    async def call(
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

        async def attempt() -> Dict[str, Any]:
            r = await self.client.post(
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

        return await self._retrying(attempt, idempotent)

    # --- server streams ---

    async def stream(
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
        abort: Optional[AsyncAbort] = None,
    ) -> AsyncIterator[Dict[str, Any]]:
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
                resp = await self.client.send(req, stream=True)
                try:
                    if abort is not None:
                        abort.bind(resp.aclose)
                    if resp.status_code != 200:
                        await resp.aread()
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
                    async for chunk in resp.aiter_raw():
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
                    await resp.aclose()
            except (httpx.TransportError, ShoalError) as e:
                if yielded:
                    if isinstance(e, httpx.TransportError):
                        raise ConnectionLost(f"{service}.{method} stream from {self.config.url} broke: {type(e).__name__}: {e}") from None
                    raise
                if attempt >= self.config.retries or not retryable(e, idempotent):
                    if isinstance(e, httpx.TransportError):
                        raise transport_error(e, self.config.url) from None
                    raise
                await async_sleep(backoff(attempt, getattr(e, "retry_after", None)))
                attempt += 1

    # --- plain HTTP endpoints (layer images) ---

    @asynccontextmanager
    async def get_stream(
        self, url: str, params: Mapping[str, str], *, what: str, request_timeout: Optional[float] = None
    ) -> AsyncIterator[httpx.Response]:
        """The streamed reply of a GET (status checked; retried until it starts)."""

        async def attempt() -> httpx.Response:
            r = await self.client.send(self.client.build_request("GET", url, params=params, timeout=self._timeout(request_timeout)), stream=True)
            if r.status_code != 200:
                await r.aread()
                await r.aclose()
                err = http_error(r.status_code, r.content, what=what)
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r

        resp = await self._retrying(attempt, True)
        try:
            yield resp
        except httpx.TransportError as e:
            raise ConnectionLost(f"{what} broke: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()

    async def send_body(
        self,
        method: str,
        url: str,
        params: Mapping[str, str],
        content: Callable[[], Union[bytes, AsyncIterator[bytes]]],
        *,
        what: str,
        idempotent: bool,
        content_type: str = "application/octet-stream",
        request_timeout: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Send a body (made afresh by ``content()`` for each attempt) and
        return the JSON reply. Retried only when ``idempotent``."""

        async def attempt() -> Dict[str, Any]:
            body = content()
            try:
                r = await self.client.request(
                    method,
                    url,
                    params=params,
                    content=body,
                    headers={"Content-Type": content_type},
                    timeout=self._timeout(request_timeout),
                )
            finally:
                aclose = getattr(body, "aclose", None)  # a generator holding a file
                if aclose is not None:
                    await aclose()
            if r.status_code != 200:
                err = http_error(r.status_code, r.content, what=what)
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r.json() if r.content else {}

        return await self._retrying(attempt, idempotent)

    async def post_ndjson(
        self,
        url: str,
        params: Mapping[str, str],
        content: AsyncIterator[bytes],
        *,
        what: str,
        content_type: str = "application/octet-stream",
        request_timeout: Optional[float] = None,
    ) -> AsyncIterator[Dict[str, Any]]:
        """POST a streamed body (sent once: not retried) and yield the
        messages of the NDJSON reply; an error line raises."""
        try:
            try:
                resp = await self.client.send(
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
            aclose = getattr(content, "aclose", None)  # the server may answer before the body is sent
            if aclose is not None:
                await aclose()
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise http_error(resp.status_code, resp.content, what=what)
            async for line in resp.aiter_lines():
                if line.strip():
                    yield decode_ndjson(line)
        except httpx.TransportError as e:
            raise ConnectionLost(f"{what} broke: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()

    # --- file bytes ---

    def _file_url(self, sandbox_id: str, path: str, mode: Optional[str] = None, user: Optional[str] = None) -> Tuple[str, Dict[str, str]]:
        params = {"path": path}
        if mode is not None:
            params["mode"] = mode
        if user:
            params["user"] = user
        return f"/v1/sandboxes/{sandbox_id}/files", params

    @asynccontextmanager
    async def get_file(self, sandbox_id: str, path: str, *, request_timeout: Optional[float] = None, user: Optional[str] = None) -> AsyncIterator[httpx.Response]:
        """The streamed reply of GET /v1/sandboxes/{id}/files (status checked)."""
        url, params = self._file_url(sandbox_id, path, user=user)

        async def attempt() -> httpx.Response:
            r = await self.client.send(self.client.build_request("GET", url, params=params, timeout=self._timeout(request_timeout)), stream=True)
            if r.status_code != 200:
                await r.aread()
                await r.aclose()
                err = http_error(r.status_code, r.content, what="file download")
                err.retry_after = retry_after(r)  # type: ignore[attr-defined]
                raise err
            return r

        resp = await self._retrying(attempt, True)
        try:
            yield resp
        except httpx.TransportError as e:
            raise ConnectionLost(f"download of {path} broke: {type(e).__name__}: {e}") from None
        finally:
            await resp.aclose()

    async def put_file(
        self,
        sandbox_id: str,
        path: str,
        content: Union[bytes, AsyncIterator[bytes]],
        *,
        mode: Optional[str],
        request_timeout: Optional[float] = None,
        user: Optional[str] = None,
    ) -> Dict[str, Any]:
        """PUT /v1/sandboxes/{id}/files: atomically replaces the file.

        Retried only when the body is bytes (it can be sent again)."""
        url, params = self._file_url(sandbox_id, path, mode, user)

        async def attempt() -> Dict[str, Any]:
            r = await self.client.put(
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

        return await self._retrying(attempt, isinstance(content, bytes))


_pools: "AsyncPools[AsyncTransport]" = AsyncPools()


def transport_for(
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    retries: Optional[int] = None,
) -> AsyncTransport:
    """The shared transport for these settings (one connection pool each;
    asyncio: in the running event loop)."""
    config = ConnectionConfig.resolve(url=url, api_key=api_key, request_timeout=request_timeout, retries=retries)
    return _pools.get(config.key, lambda: AsyncTransport(config))


async def aclose() -> None:
    """Close the shared connection pools; they reopen on the next call.
    asyncio: the running loop's (call before the loop ends to release
    sockets at once)."""
    await _pools.aclose()
