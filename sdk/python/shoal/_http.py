"""The HTTP client settings both clients share: headers, timeouts, pool
limits, TLS, proxies, and the httpx client of each kind (see
``shoal._concurrency`` for the rest that differs)."""

from __future__ import annotations

import inspect
import socket
from typing import Any, Dict
from urllib.parse import urlsplit

import httpx

from ._config import VERSION, ConnectionConfig

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


def _rpc_path(service: str, method: str) -> str:
    return f"/shoal.v1.{service}/{method}"


def async_pool_client(kw: Dict[str, Any]) -> httpx.AsyncClient:
    """The client of a shared pool (``_client_kwargs``)."""
    return httpx.AsyncClient(**kw)


def pool_client(kw: Dict[str, Any]) -> httpx.Client:
    kw["transport"] = _nodelay_transport(kw.pop("limits"), kw["trust_env"], kw["verify"])
    return httpx.Client(**kw)


def async_port_client(kw: Dict[str, Any]) -> httpx.AsyncClient:
    """A client of a sandbox's port (``_port_client_kwargs``): httpx's own
    pool limits."""
    kw.pop("limits", None)
    return httpx.AsyncClient(**kw)


def port_client(kw: Dict[str, Any]) -> httpx.Client:
    kw["transport"] = _nodelay_transport(kw.pop("limits"), kw["trust_env"], kw["verify"])
    return httpx.Client(**kw)
