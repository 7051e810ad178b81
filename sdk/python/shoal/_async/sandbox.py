"""``AsyncSandbox`` (asyncio API)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Union
from urllib.parse import urlsplit

import httpx

from .._protocol import create_body, seconds
from .._util import instance_or_class
from ..exceptions import InvalidArgument, SandboxNotFound
from .._http import _port_client_kwargs, async_port_client
from ..models import BuildProgress, Layer, SandboxInfo, TrajectoryInfo
from .commands import AsyncCommands, AsyncPty
from .filesystem import AsyncFiles
from .sessions import AsyncShells, AsyncTrajectory
from .transport import AsyncTransport, transport_for


class AsyncSandbox:
    """A sandbox: an isolated environment to run commands and keep files in.

    Create one with :meth:`create` (or re-attach with :meth:`connect`); use
    ``sb.commands``, ``sb.files``, ``sb.pty``, ``sb.shells`` and
    ``sb.trajectory(...)``; :meth:`kill` it when done, or use it as a
    ``async with`` context manager. The asyncio one's methods that talk to
    the server are coroutines: use it from one event loop. The blocking one
    is safe to use from several threads.
    """

    def __init__(self, info: SandboxInfo, transport: AsyncTransport) -> None:
        self._transport = transport
        self._info = info
        self.sandbox_id: str = info.sandbox_id
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = AsyncPty(self)
        self.shells = AsyncShells(self)

    @property
    def id(self) -> str:
        """The sandbox's ID (same as ``sandbox_id``)."""
        return self.sandbox_id

    @property
    def info(self) -> SandboxInfo:
        """What the server said about the sandbox at the last call that returned it."""
        return self._info

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.sandbox_id!r}, backend={self._info.backend!r}, state={self._info.state!r})"

    # --- lifecycle ---

    @classmethod
    async def create(
        cls,
        template: Optional[str] = None,
        timeout: Union[int, float, timedelta, None] = None,
        metadata: Optional[Dict[str, str]] = None,
        envs: Optional[Dict[str, str]] = None,
        *,
        base: Optional[str] = None,
        workspaces: Optional[Sequence[str]] = None,
        toolkits: Optional[Sequence[str]] = None,
        backend: Optional[str] = None,
        cpus: Optional[float] = None,
        memory: Union[str, int, None] = None,
        disk: Union[str, int, None] = None,
        log_budget: Union[str, int, None] = None,
        qos: Optional[str] = None,
        client_key: Optional[str] = None,
        allow_internet_access: bool = False,
        allow_out: Optional[Sequence[str]] = None,
        deny_out: Optional[Sequence[str]] = None,
        auto_pause: Union[int, float, timedelta, None] = None,
        api_key: Optional[str] = None,
        url: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> "AsyncSandbox":
        """Create a sandbox and return once it is ready for commands.

        :param template: a named environment (a saved base + workspaces +
            toolkits); or give the layers with ``base``/``workspaces``/``toolkits``.
        :param timeout: idle timeout in seconds (default 30 minutes): the
            sandbox is deleted after this long without a call or a running
            command. ``set_timeout`` changes it.
        :param metadata: your labels, returned by ``list()``.
        :param envs: environment variables of every command.
        :param base: base layer ref (``name:version``, ``name@sha256:...``).
        :param workspaces: workspace layer refs (first wins).
        :param toolkits: toolkit layer refs (first wins, above workspaces).
        :param backend: ``"container"`` (default), ``"microvm"``, ``"fullvm"``
            or ``"fncall"``; the rest of the API is the same on all of them.
        :param cpus: cores (e.g. ``0.5``; default 1).
        :param memory: bytes or a size such as ``"512M"`` (default 512 MiB).
        :param disk: size of the sandbox's writable layer, bytes or a size
            such as ``"4G"`` (default: the server's, 1 GiB): a file system of
            its own, on which writes past it fail with ENOSPC.
        :param log_budget: bytes (or a size such as ``"64M"``) of its
            commands' output logs (trajectory steps and shells included) the
            node keeps; past it the oldest output is pruned, ended commands'
            first, and reading pruned output raises :class:`LogPruned`
            (default: the server's, a quarter of the disk; at least 1 MiB).
        :param qos: CPU class: ``"ls"`` (latency-sensitive, the default) or
            ``"be"`` (best effort: the lowest CPU weight, its processes under
            SCHED_IDLE; it gets the CPU latency-sensitive sandboxes leave).
        :param auto_pause: pause the sandbox (and reclaim its memory) after
            this many seconds without a call or a running command; 0: never;
            default: the server's ``--auto-pause``. Any call resumes it.
        :param client_key: idempotency key: repeating a create with the same
            key returns the same sandbox. One is generated per call when not
            given, which makes the create safe to retry after a lost
            connection or a capacity refusal.
        :param allow_internet_access: network egress to the public IPv4
            internet (not private ranges, other sandboxes or the host), minus
            ``deny_out``. Default: no network (loopback only).
        :param allow_out: network egress to these ``"CIDR"``, ``"IP"``,
            ``"CIDR:PORT"`` or ``"CIDR:LOW-HIGH"`` (at most 64; may name a
            private range; wins over ``deny_out``).
        :param deny_out: CIDRs taken out of ``allow_internet_access``.
        :param api_key: default ``SHOAL_API_KEY``, then ``/var/lib/shoal/admin.key``.
        :param url: default ``SHOAL_URL``, then ``http://127.0.0.1:7480``.
        :param request_timeout: seconds to wait for the server's reply.
        """
        t = transport_for(api_key=api_key, url=url)
        body = create_body(
            template=template,
            base=base,
            workspaces=workspaces,
            toolkits=toolkits,
            backend=backend,
            cpus=cpus,
            memory=memory,
            disk=disk,
            log_budget=log_budget,
            timeout=timeout,
            metadata=metadata,
            envs=envs,
            qos=qos,
            client_key=client_key or uuid.uuid4().hex,
            allow_internet_access=allow_internet_access,
            allow_out=allow_out,
            deny_out=deny_out,
            auto_pause=auto_pause,
        )
        r = await t.call("SandboxService", "CreateSandbox", body, idempotent=True, request_timeout=request_timeout)
        return cls(SandboxInfo.from_json(r), t)

    @classmethod
    async def connect(
        cls,
        sandbox_id: str,
        api_key: Optional[str] = None,
        url: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> "AsyncSandbox":
        """Attach to an existing sandbox by ID (resuming it if it is paused)."""
        t = transport_for(api_key=api_key, url=url)
        info = await cls._get(t, sandbox_id, request_timeout)
        sb = cls(info, t)
        if info.state == "paused":
            await sb.resume(request_timeout=request_timeout)
        return sb

    @classmethod
    async def list(
        cls,
        metadata: Optional[Dict[str, str]] = None,
        state: Optional[Sequence[str]] = None,
        api_key: Optional[str] = None,
        url: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> List[SandboxInfo]:
        """Every sandbox, optionally only those whose metadata contains
        ``metadata`` and whose state is in ``state`` (e.g. ``["running"]``)."""
        t = transport_for(api_key=api_key, url=url)
        r = await t.call("SandboxService", "ListSandboxes", {}, idempotent=True, request_timeout=request_timeout)
        out = [SandboxInfo.from_json(s) for s in r.get("sandboxes") or []]
        if metadata:
            out = [s for s in out if all(s.metadata.get(k) == v for k, v in metadata.items())]
        if state:
            out = [s for s in out if s.state in state]
        return out

    @staticmethod
    async def _get(t: AsyncTransport, sandbox_id: str, request_timeout: Optional[float]) -> SandboxInfo:
        if not sandbox_id:
            raise InvalidArgument("a sandbox ID is required")
        r = await t.call("SandboxService", "GetSandbox", {"id": sandbox_id}, idempotent=True, request_timeout=request_timeout, sandbox_call=True)
        return SandboxInfo.from_json(r)

    # Methods usable both as sb.kill() and AsyncSandbox.kill(sandbox_id) (as in E2B).

    @classmethod
    async def _kill_by_id(
        cls, sandbox_id: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
    ) -> bool:
        t = transport_for(api_key=api_key, url=url)
        try:
            await t.call("SandboxService", "DeleteSandbox", {"id": sandbox_id}, idempotent=True, request_timeout=request_timeout, sandbox_call=True)
            return True
        except SandboxNotFound:
            return False

    @instance_or_class("_kill_by_id")
    async def kill(self, request_timeout: Optional[float] = None) -> bool:
        """Delete the sandbox and everything in it. False if it was already gone."""
        try:
            await self._call("DeleteSandbox", {"id": self.sandbox_id}, request_timeout)
            return True
        except SandboxNotFound:
            return False

    @classmethod
    async def _set_timeout_by_id(
        cls,
        sandbox_id: str,
        timeout: Union[int, float, timedelta],
        api_key: Optional[str] = None,
        url: Optional[str] = None,
        request_timeout: Optional[float] = None,
    ) -> SandboxInfo:
        return await (await cls.connect(sandbox_id, api_key=api_key, url=url, request_timeout=request_timeout)).set_timeout(timeout, request_timeout)

    @instance_or_class("_set_timeout_by_id")
    async def set_timeout(self, timeout: Union[int, float, timedelta], request_timeout: Optional[float] = None) -> SandboxInfo:
        """Set the idle timeout (seconds) and restart its clock."""
        t = seconds(timeout, "timeout")
        if not t:
            raise InvalidArgument("timeout must be at least 1 second")
        self._info = SandboxInfo.from_json(await self._call("SetTimeout", {"id": self.sandbox_id, "timeoutSeconds": str(int(t))}, request_timeout))
        return self._info

    @classmethod
    async def _get_info_by_id(
        cls, sandbox_id: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
    ) -> SandboxInfo:
        return await cls._get(transport_for(api_key=api_key, url=url), sandbox_id, request_timeout)

    @instance_or_class("_get_info_by_id")
    async def get_info(self, request_timeout: Optional[float] = None) -> SandboxInfo:
        """Fetch the sandbox's current state from the server."""
        self._info = await self._get(self._transport, self.sandbox_id, request_timeout)
        return self._info

    async def is_running(self, request_timeout: Optional[float] = None) -> bool:
        """Whether the sandbox exists and is running."""
        try:
            return (await self.get_info(request_timeout)).state == "running"
        except SandboxNotFound:
            return False

    async def pause(self, request_timeout: Optional[float] = None, keep_memory: bool = True) -> SandboxInfo:
        """Pause the sandbox: its processes stop where they are and the node
        reclaims its memory (``info.pause`` says how much). Any later call
        that needs it (commands, files, ports) resumes it, or :meth:`resume`
        does. Pausing a paused sandbox changes nothing.

        With ``keep_memory=False`` (E2B's ``keepMemory: false``) its processes
        end first (its commands and shells are closed) and only its files are
        kept: it resumes with its files and none of its processes
        (``info.pause.fs_only``)."""
        body: Dict[str, Any] = {"id": self.sandbox_id}
        if not keep_memory:
            body["fsOnly"] = True
        r = await self._call("PauseSandbox", body, request_timeout)
        self._info = SandboxInfo.from_json(r.get("sandbox") or {}) if (r.get("sandbox") or {}).get("id") else self._info
        return self._info

    async def resume(self, request_timeout: Optional[float] = None) -> SandboxInfo:
        """Resume a paused sandbox (a running one is left as it is)."""
        r = await self._call("ResumeSandbox", {"id": self.sandbox_id}, request_timeout)
        self._info = SandboxInfo.from_json(r.get("sandbox") or {}) if (r.get("sandbox") or {}).get("id") else self._info
        return self._info

    async def reset(self, request_timeout: Optional[float] = None) -> SandboxInfo:
        """Reset the sandbox to its start, in place: every process but its
        agent ends, its writable layer is replaced by an empty one (files,
        /tmp, /dev/shm, SysV IPC and listening sockets go), its commands and
        shells are closed with the reason ``"reset"`` (a command handle's
        wait raises :class:`CommandReset`), and it keeps its ID, limits and
        network. A paused sandbox is resumed first. Not retried: a second
        reset would close what ran after the first."""
        r = await self._transport.call("SandboxService", "ResetSandbox", {"id": self.sandbox_id}, idempotent=False, request_timeout=request_timeout, sandbox_call=True)
        self._info = SandboxInfo.from_json(r.get("sandbox") or {}) if (r.get("sandbox") or {}).get("id") else self._info
        return self._info

    async def _call(self, method: str, body: Dict[str, Any], request_timeout: Optional[float]) -> Dict[str, Any]:
        return await self._transport.call("SandboxService", method, body, idempotent=True, request_timeout=request_timeout, sandbox_call=True)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()

    # --- ports ---

    def get_host(self, port: int) -> str:
        """Where a port inside the sandbox is reachable, without the scheme
        (E2B's name): ``f"http://{sb.get_host(8000)}/path"`` is a URL. The
        proxy needs the API key (``X-API-Key``, or ``Authorization: Bearer``
        when the app needs no ``Authorization`` of its own);
        :meth:`http_client` sets it for you."""
        u = urlsplit(self._transport.config.url)
        return f"{u.netloc}/v1/sandboxes/{self.sandbox_id}/ports/{_port(port)}"

    def get_url(self, port: int, path: str = "") -> str:
        """Full URL of ``path`` on a port inside the sandbox."""
        u = urlsplit(self._transport.config.url)
        return f"{u.scheme}://{self.get_host(port)}/{path.lstrip('/')}"

    def http_client(self, port: int, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` whose relative URLs go to ``port`` inside the
        sandbox, authenticated. Close it (or use ``with``) when done."""
        kw = _port_client_kwargs(self._transport.config, kwargs)
        kw["base_url"] = self.get_url(port)
        kw.update(kwargs)
        return async_port_client(kw)

    # --- layers ---

    async def commit(
        self,
        kind: str,
        ref: str,
        *,
        compression: Optional[str] = None,
        on_progress: Optional[Callable[[BuildProgress], Any]] = None,
        request_timeout: Optional[float] = None,
    ) -> Layer:
        """Turn what this sandbox changed (its writable layer) into a new
        ``"workspace"`` or ``"toolkit"`` layer tagged ``ref`` (``name:version``).

        Created over the same layers plus the new one, a sandbox sees this
        one's files (deletions included). The sandbox keeps running.
        ``on_progress`` gets :class:`~shoal.BuildProgress` events.
        See :func:`shoal.layers.acommit`.
        """
        from .. import layers

        return await layers.acommit(self, kind, ref, compression=compression, on_progress=on_progress, request_timeout=request_timeout)

    # --- trajectories ---

    def trajectory(self, trajectory_id: str, start_step: int = 1) -> AsyncTrajectory:
        """A trajectory: steps numbered by the SDK, recorded by the server,
        replayed instead of re-run when the same script runs again."""
        return AsyncTrajectory(self, trajectory_id, start_step)

    async def list_trajectories(self, request_timeout: Optional[float] = None) -> List[TrajectoryInfo]:
        """The sandbox's trajectories (without their steps)."""
        r = await self._transport.call("CommandService", "ListTrajectories", {"sandboxId": self.sandbox_id}, idempotent=True, request_timeout=request_timeout)
        return [TrajectoryInfo.from_json(x) for x in r.get("trajectories") or []]


def _port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgument(f"port {port!r} must be 1-65535")
    return port
