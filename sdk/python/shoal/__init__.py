"""Shoal's Python SDK: sandboxes for agentic RL, sync and asyncio.

    from shoal import Sandbox

    with Sandbox.create(base="debian:12") as sb:
        r = sb.commands.run("python3 -c 'print(6*7)'")
        print(r.stdout)                      # 42
        sb.files.write("/work/a.txt", "hello")

``AsyncSandbox`` has the same surface with ``await``. Names follow E2B's SDK
where it has the same thing. ``shoal.layers`` builds, lists, commits, tags,
removes, exports and imports layers; ``shoal.environments`` manages named
stacks of layers (templates); ``shoal.fncall`` runs judged one-shot calls.
Configuration: arguments, else ``SHOAL_URL`` and ``SHOAL_API_KEY``, else
``/var/lib/shoal/admin.key``; TLS from ``SHOAL_CA``, ``SHOAL_CERT`` and
``SHOAL_CERT_KEY``.
"""

from . import environments, fncall, layers, monitor
from ._async.commands import AsyncCommandHandle, AsyncCommands, AsyncPty
from ._async.filesystem import AsyncFiles, AsyncWatchHandle
from ._async.sandbox import AsyncSandbox
from ._async.sessions import AsyncShell, AsyncShells, AsyncTrajectory
from ._async.transport import aclose
from ._config import VERSION as __version__
from ._config import ConnectionConfig
from ._sync.commands import CommandHandle, Commands, Pty
from ._sync.filesystem import Files, WatchHandle
from ._sync.sandbox import Sandbox
from ._sync.sessions import Shell, Shells, Trajectory
from ._sync.transport import close
from .exceptions import (
    Aborted,
    AlreadyExists,
    AuthenticationException,
    AuthError,
    Canceled,
    CapacityExhausted,
    CommandExitException,
    CommandNotExecutable,
    CommandNotFound,
    CommandTimeout,
    ConnectionLost,
    FailedPrecondition,
    InvalidArgument,
    InvalidArgumentException,
    LayerInUse,
    LayerNotFound,
    LogPruned,
    NotFound,
    NotFoundException,
    NotSupported,
    PermissionDenied,
    SandboxException,
    SandboxKilled,
    CommandReset,
    SandboxNotFound,
    ServerError,
    ShoalError,
    Timeout,
    TimeoutException,
    TrajectoryDiverged,
    Unavailable,
)
from .models import (
    BuildProgress,
    CommandInfo,
    CommandResult,
    EntryInfo,
    Environment,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    GCResult,
    Image,
    ImageConfig,
    Layer,
    LayerRef,
    ProcessInfo,
    PtySize,
    RemoveResult,
    SandboxInfo,
    ShellInfo,
    ShellResult,
    TagResult,
    PushResult,
    TrajectoryInfo,
    TrajectoryStep,
    WriteInfo,
)

Filesystem = Files  # E2B's name
AsyncFilesystem = AsyncFiles

__all__ = [
    "environments",
    "fncall",
    "layers",
    "monitor",
    "Aborted",
    "AlreadyExists",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncFiles",
    "AsyncFilesystem",
    "AsyncPty",
    "AsyncSandbox",
    "AsyncShell",
    "AsyncShells",
    "AsyncTrajectory",
    "AsyncWatchHandle",
    "AuthError",
    "AuthenticationException",
    "BuildProgress",
    "Canceled",
    "CapacityExhausted",
    "CommandExitException",
    "CommandNotExecutable",
    "CommandNotFound",
    "CommandHandle",
    "CommandInfo",
    "CommandResult",
    "CommandTimeout",
    "Commands",
    "ConnectionConfig",
    "ConnectionLost",
    "EntryInfo",
    "Environment",
    "Image",
    "ImageConfig",
    "FailedPrecondition",
    "FileType",
    "Files",
    "Filesystem",
    "FilesystemEvent",
    "FilesystemEventType",
    "GCResult",
    "InvalidArgument",
    "InvalidArgumentException",
    "Layer",
    "LayerInUse",
    "LayerNotFound",
    "LayerRef",
    "NotFound",
    "NotFoundException",
    "NotSupported",
    "PermissionDenied",
    "ProcessInfo",
    "Pty",
    "PtySize",
    "RemoveResult",
    "Sandbox",
    "SandboxException",
    "SandboxInfo",
    "SandboxKilled",
    "CommandReset",
    "LogPruned",
    "SandboxNotFound",
    "ServerError",
    "Shell",
    "ShellInfo",
    "ShellResult",
    "Shells",
    "ShoalError",
    "TagResult",
    "PushResult",
    "Timeout",
    "TimeoutException",
    "Trajectory",
    "TrajectoryDiverged",
    "TrajectoryInfo",
    "TrajectoryStep",
    "Unavailable",
    "WatchHandle",
    "WriteInfo",
    "aclose",
    "close",
]
