"""Values returned by the SDK (plain dataclasses, the same for sync and async).

Field names follow E2B's SDK where it has the same thing (``sandbox_id``,
``exit_code``, ``EntryInfo``, ``FileType``, ``FilesystemEvent``, ``PtySize``),
with Shoal's additions beside them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional

__all__ = [
    "SandboxInfo",
    "LayerRef",
    "CommandResult",
    "CommandInfo",
    "ProcessInfo",
    "EntryInfo",
    "FileType",
    "WriteInfo",
    "FilesystemEvent",
    "FilesystemEventType",
    "PtySize",
    "ShellInfo",
    "ShellResult",
    "TrajectoryStep",
    "TrajectoryInfo",
    "Layer",
    "BuildProgress",
    "TagResult",
    "RemoveResult",
    "GCResult",
    "Environment",
]


# --- JSON helpers (protojson: int64 as strings, enums as names, RFC 3339 times) ---

_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?$")


def _time(v: Any) -> Optional[datetime]:
    if not v:
        return None
    m = _TS.match(v)
    if not m:
        return None
    base, frac, tz = m.groups()
    s = base + ("." + (frac + "000000")[:6] if frac else "")
    dt = datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%f" if frac else "%Y-%m-%dT%H:%M:%S")
    if tz in (None, "Z"):
        return dt.replace(tzinfo=timezone.utc)
    return datetime.fromisoformat(dt.isoformat() + tz)


def _int(v: Any) -> int:
    return int(v) if v not in (None, "") else 0


def _enum(v: Any, prefix: str) -> str:
    """'SANDBOX_STATE_RUNNING' -> 'running' (0/unset -> 'unspecified')."""
    if isinstance(v, int) or v is None:
        return "unspecified" if not v else str(v)
    return v[len(prefix):].lower() if v.startswith(prefix) else v.lower()


# --- sandboxes ---


@dataclass
class LayerRef:
    """One layer of a sandbox as resolved at creation (the digest is what it runs on)."""

    kind: str  # "base", "workspace", "toolkit"
    ref: str
    digest: str


@dataclass
class SandboxInfo:
    """A sandbox as the server describes it.

    ``started_at``/``end_at``/``cpu_count``/``memory_mb`` are E2B's names for
    ``created_at``/``expires_at``/``cpus``/``memory_bytes``.
    """

    sandbox_id: str
    backend: str
    state: str  # "creating", "running", "paused", "deleting", "error"
    layers: List[LayerRef]
    memory_bytes: int
    cpus: float
    pids_limit: int
    timeout: int  # idle timeout in seconds
    created_at: Optional[datetime]
    expires_at: Optional[datetime]
    metadata: Dict[str, str]
    error: str = ""
    template: str = ""
    client_key: str = ""
    disk_bytes: int = 0  # size of the writable layer; 0: not limited
    log_budget_bytes: int = 0  # its commands' logs the node keeps, at most
    qos: str = "ls"  # CPU class: "ls" or "be"
    auto_pause: int = 0  # seconds idle before it is paused; 0 = never
    pause: Optional["PauseInfo"] = None  # the last pause, if any
    image: Optional["ImageConfig"] = None  # made from a pulled OCI image: its config (its command: entrypoint + cmd)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def started_at(self) -> Optional[datetime]:
        """E2B's name for ``created_at``."""
        return self.created_at

    @property
    def end_at(self) -> Optional[datetime]:
        """E2B's name for ``expires_at`` (when the idle timeout deletes it)."""
        return self.expires_at

    @property
    def cpu_count(self) -> float:
        """E2B's name for ``cpus``."""
        return self.cpus

    @property
    def memory_mb(self) -> int:
        """``memory_bytes`` in MiB (E2B's name)."""
        return self.memory_bytes >> 20

    @property
    def template_id(self) -> str:
        """E2B's name for ``template``."""
        return self.template

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        return cls(
            sandbox_id=d.get("id", ""),
            backend=d.get("backend", ""),
            state=_enum(d.get("state"), "SANDBOX_STATE_"),
            layers=[
                LayerRef(_enum(l.get("kind"), "LAYER_KIND_"), l.get("ref", ""), l.get("digest", ""))
                for l in d.get("layers") or []
            ],
            memory_bytes=_int(d.get("memoryBytes")),
            cpus=_int(d.get("millicpu")) / 1000.0,
            pids_limit=_int(d.get("pidsLimit")),
            disk_bytes=_int(d.get("diskBytes")),
            log_budget_bytes=_int(d.get("logBudgetBytes")),
            qos=d.get("qos") or "ls",
            timeout=_int(d.get("timeoutSeconds")),
            created_at=_time(d.get("createdAt")),
            expires_at=_time(d.get("expiresAt")),
            metadata=dict(d.get("metadata") or {}),
            error=d.get("error", ""),
            template=d.get("template", ""),
            client_key=d.get("clientKey", ""),
            auto_pause=_int(d.get("autoPauseSeconds")),
            pause=PauseInfo.from_json(d["pause"]) if d.get("pause") else None,
            image=ImageConfig.from_json(d["image"]) if d.get("image") else None,
            raw=dict(d),
        )


@dataclass
class PauseInfo:
    """What a sandbox's last pause did (memory in bytes, -1 if unknown)."""

    paused_at: Optional[datetime]
    auto: bool  # by the idle policy (auto-pause)
    memory_before: int
    memory_after: int
    swapped_out: int
    method: str  # how memory was reclaimed, and any error
    freeze_seconds: float
    reclaim_seconds: float
    resumed_at: Optional[datetime]  # None while paused
    resume_seconds: float
    # Memory pressure moved its memory off the host since (a VM paused in
    # place, snapshotted to a file): how long that took, the file's size.
    evicted: bool = False
    evict_seconds: float = 0.0
    evicted_to: int = 0
    # The host had no swap (serve could not set up zram, or --zram-size 0):
    # the pause reclaimed file pages only, anonymous memory stayed resident.
    file_pages_only: bool = False
    #: The pause ended the sandbox's processes first (``pause(keep_memory=False)``): its files are kept, its processes are not.
    fs_only: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PauseInfo":
        return cls(
            paused_at=_time(d.get("pausedAt")),
            auto=bool(d.get("auto", False)),
            memory_before=_int(d.get("memoryBeforeBytes")),
            memory_after=_int(d.get("memoryAfterBytes")),
            swapped_out=_int(d.get("swappedOutBytes")),
            method=d.get("method", ""),
            freeze_seconds=float(d.get("freezeSeconds", 0) or 0),
            reclaim_seconds=float(d.get("reclaimSeconds", 0) or 0),
            resumed_at=_time(d.get("resumedAt")),
            resume_seconds=float(d.get("resumeSeconds", 0) or 0),
            evicted=bool(d.get("evicted", False)),
            evict_seconds=float(d.get("evictSeconds", 0) or 0),
            evicted_to=_int(d.get("evictedToBytes", 0)),
            file_pages_only=bool(d.get("filePagesOnly", False)),
            fs_only=bool(d.get("fsOnly", False)),
        )


# --- commands ---


@dataclass
class CommandResult:
    """How a command ended (E2B's ``CommandResult`` plus Shoal's fields).

    ``stdout``/``stderr`` are decoded as UTF-8 (invalid bytes replaced);
    under a PTY the terminal output is in ``stdout``.
    """

    stdout: str
    stderr: str
    exit_code: int
    error: Optional[str] = None
    command_id: str = ""
    pid: int = 0
    signal: str = ""  # e.g. "SIGKILL" when killed by a signal
    timed_out: bool = False
    replayed: bool = False  # a recorded trajectory step, returned without running it again
    step: int = 0  # the trajectory step, if any
    dropped_bytes: int = 0  # output dropped past the server's log cap


@dataclass
class CommandInfo:
    """A command as a server-side object (E2B: ``ProcessInfo``)."""

    id: str
    sandbox_id: str
    pid: int
    args: List[str]
    cwd: str
    state: str  # "running", "exited", "lost"
    exit_code: Optional[int]
    signal: str
    timed_out: bool
    started_at: Optional[datetime]
    ended_at: Optional[datetime]
    log_bytes: int
    dropped_bytes: int
    pty: bool
    trajectory_id: str
    step: int
    replayed: bool
    envs: Dict[str, str] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """E2B's name for a process's identifier: here, the command ID."""
        return self.id

    @property
    def cmd(self) -> str:
        """The program (``args[0]``), as E2B's ``ProcessInfo.cmd``."""
        return self.args[0] if self.args else ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "CommandInfo":
        ex = d.get("exit")
        state = _enum(d.get("state"), "COMMAND_STATE_")
        return cls(
            id=d.get("id", ""),
            sandbox_id=d.get("sandboxId", ""),
            pid=_int(d.get("pid")),
            args=list(d.get("args") or []),
            cwd=d.get("cwd", ""),
            state=state,
            exit_code=_int(ex.get("code")) if ex is not None else None,
            signal=(ex or {}).get("signal", ""),
            timed_out=bool((ex or {}).get("timedOut")),
            started_at=_time(d.get("startedAt")),
            ended_at=_time(d.get("endedAt")),
            log_bytes=_int(d.get("logBytes")),
            dropped_bytes=_int(d.get("droppedBytes")),
            pty=bool(d.get("pty")),
            trajectory_id=d.get("trajectoryId", ""),
            step=_int(d.get("step")),
            replayed=bool(d.get("replayed")),
        )


ProcessInfo = CommandInfo  # E2B's name


@dataclass
class PtySize:
    """Terminal size for ``sb.pty.create()`` and ``resize()``."""

    rows: int = 24
    cols: int = 80


# --- files ---


class FileType(str, enum.Enum):
    """E2B's file types."""

    FILE = "file"
    DIR = "dir"


@dataclass
class EntryInfo:
    """A file or directory in a sandbox (E2B's ``EntryInfo``)."""

    name: str
    path: str
    type: FileType
    size: int
    mode: int  # permission bits, e.g. 0o644
    symlink_target: Optional[str]
    modified_time: Optional[datetime]
    owner: str = ""  # the owner's name in the sandbox's /etc/passwd (else its uid)
    group: str = ""  # the group's name in its /etc/group (else its gid)

    @property
    def is_dir(self) -> bool:
        """Whether the entry is a directory."""
        return self.type == FileType.DIR

    @property
    def permissions(self) -> str:
        """``rwxr-xr-x`` form of ``mode``."""
        s = ""
        for shift in (6, 3, 0):
            b = (self.mode >> shift) & 7
            s += ("r" if b & 4 else "-") + ("w" if b & 2 else "-") + ("x" if b & 1 else "-")
        return s

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "EntryInfo":
        return cls(
            name=d.get("name", ""),
            path=d.get("path", ""),
            type=FileType.DIR if d.get("isDir") else FileType.FILE,
            size=_int(d.get("size")),
            mode=_int(d.get("mode")),
            symlink_target=d.get("symlink") or None,
            modified_time=_time(d.get("modifiedAt")),
            owner=d.get("owner", ""),
            group=d.get("group", ""),
        )


@dataclass
class WriteInfo:
    """What ``files.write()`` wrote (E2B's ``WriteInfo`` plus the byte count)."""

    name: str
    path: str
    type: FileType = FileType.FILE
    bytes: int = 0


class FilesystemEventType(str, enum.Enum):
    """E2B's file system event types."""

    CHMOD = "chmod"
    CREATE = "create"
    REMOVE = "remove"
    RENAME = "rename"
    WRITE = "write"
    OVERFLOW = "overflow"  # events were lost: re-scan ``path``


@dataclass
class FilesystemEvent:
    """One change seen by ``files.watch_dir()``; ``name`` is relative to the
    watched directory, ``old_path`` is set for renames."""

    name: str
    type: FilesystemEventType
    path: str = ""
    is_dir: bool = False
    old_path: str = ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any], root: str) -> "FilesystemEvent":
        path = d.get("path", "")
        prefix = root.rstrip("/") + "/"
        name = path[len(prefix):] if path.startswith(prefix) else path
        op = _enum(d.get("op"), "OP_")
        try:
            typ = FilesystemEventType(op)
        except ValueError:
            typ = FilesystemEventType.WRITE
        return cls(name=name, type=typ, path=path, is_dir=bool(d.get("isDir")), old_path=d.get("oldPath", ""))


# --- shells and trajectories ---


@dataclass
class ShellInfo:
    """A named persistent shell in a sandbox."""

    name: str
    sandbox_id: str
    command_id: str
    created_at: Optional[datetime]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShellInfo":
        return cls(
            name=d.get("name", ""),
            sandbox_id=d.get("sandboxId", ""),
            command_id=d.get("commandId", ""),
            created_at=_time(d.get("createdAt")),
        )


@dataclass
class ShellResult:
    """What a command line run in a shell printed (stdout and stderr as a terminal shows them)."""

    output: str
    exit_code: int
    timed_out: bool = False

    @property
    def stdout(self) -> str:
        """The output (a shell's stdout and stderr are one terminal stream)."""
        return self.output


@dataclass
class TrajectoryStep:
    """One recorded step of a trajectory."""

    step: int
    command_id: str
    args: List[str]
    request_digest: str
    command: Optional[CommandInfo]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TrajectoryStep":
        c = d.get("command")
        return cls(
            step=_int(d.get("step")),
            command_id=d.get("commandId", ""),
            args=list(d.get("args") or []),
            request_digest=d.get("requestDigest", ""),
            command=CommandInfo.from_json(c) if c else None,
        )


@dataclass
class TrajectoryInfo:
    """A trajectory: the steps recorded under one client-chosen ID."""

    id: str
    sandbox_id: str
    steps: List[TrajectoryStep]

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TrajectoryInfo":
        return cls(
            id=d.get("id", ""),
            sandbox_id=d.get("sandboxId", ""),
            steps=[TrajectoryStep.from_json(s) for s in d.get("steps") or []],
        )


# --- layers and environments ---


def _get(d: Mapping[str, Any], json_name: str, proto_name: str) -> Any:
    """A field by its JSON name, else its proto name (the import endpoint
    replies with proto names)."""
    v = d.get(json_name)
    return d.get(proto_name) if v is None else v


@dataclass
class Layer:
    """A read-only layer image (``base``, ``workspace`` or ``toolkit``).

    ``ref`` is the tag this entry is listed under (``name:version``; empty
    for an untagged image), ``digest`` the content address of the EROFS
    image. ``tags``, ``used_by_*`` and ``mounts`` are filled by
    ``layers.get()`` (``tags`` also by ``layers.list(all=True)``).
    """

    name: str
    version: str
    kind: str  # "base", "workspace", "toolkit"
    digest: str  # sha256:<hex>
    size: int  # bytes of the EROFS image
    compression: str
    created_at: Optional[datetime]
    ref: str  # name:version
    source: str  # what it was built from, e.g. "dir /src", "commit of sandbox ID"
    files: int  # entries in the tree
    content_bytes: int  # bytes of regular files in the tree
    tags: List[str] = field(default_factory=list)
    used_by_sandboxes: List[str] = field(default_factory=list)
    used_by_environments: List[str] = field(default_factory=list)
    mounts: int = 0
    remote: str = ""  # the layer store the node reads the image from when it holds no copy
    lazy: Dict[str, Any] = field(default_factory=dict)  # lazy loader counters of a mounted s3:// image (layers.get())
    # The tenant whose tag this is; "" for a shared one (the admin's,
    # read-only to tenants). The admin names a tenant's as "tenant/name:version".
    tenant: str = ""
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def shared(self) -> bool:
        """Whether the layer is the admin's, shared: every tenant uses it,
        none changes it."""
        return self.tenant == ""

    @property
    def pinned(self) -> str:
        """A reference to exactly this image, ``name@sha256:...`` (or the
        digest alone for an untagged image): it never moves with the tag."""
        return f"{self.name}@{self.digest}" if self.name else self.digest

    @property
    def in_use(self) -> bool:
        """Whether a sandbox or an environment uses the image, or it is
        mounted (known after ``layers.get()``)."""
        return bool(self.used_by_sandboxes or self.used_by_environments or self.mounts)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Layer":
        return cls(
            name=d.get("name", ""),
            version=d.get("version", ""),
            kind=_enum(d.get("kind"), "LAYER_KIND_"),
            digest=d.get("digest", ""),
            size=_int(d.get("size")),
            compression=d.get("compression", ""),
            created_at=_time(_get(d, "createdAt", "created_at")),
            ref=d.get("ref", ""),
            source=d.get("source", ""),
            files=_int(d.get("files")),
            content_bytes=_int(_get(d, "contentBytes", "content_bytes")),
            tenant=d.get("tenant", ""),
            tags=list(d.get("tags") or []),
            used_by_sandboxes=list(_get(d, "usedBySandboxes", "used_by_sandboxes") or []),
            used_by_environments=list(_get(d, "usedByEnvironments", "used_by_environments") or []),
            mounts=_int(d.get("mounts")),
            remote=d.get("remote", ""),
            lazy=dict(d.get("lazy") or {}),
            raw=dict(d),
        )


@dataclass
class BuildProgress:
    """One progress event of a layer build or commit, for ``on_progress``.

    Either a line at the start of each stage (``message`` set, e.g.
    ``"scanning /src"``), or a status update for a progress bar
    (``message`` empty): ``done`` of ``total`` ``unit`` (``"bytes"``,
    ``"files"``, ``"layers"``) in ``stage`` (``"extract"``, ``"unpack"``,
    ``"copy"``, ``"scan"``, ``"mkfs"``, ``"hash"``, ``"done"``; a push's
    ``"upload"`` and ``"chunks"``).
    """

    message: str = ""
    stage: str = ""
    done: int = 0
    total: int = 0  # 0 if unknown
    unit: str = ""

    @property
    def fraction(self) -> Optional[float]:
        """``done / total`` of a status update, ``None`` when the total is unknown."""
        return self.done / self.total if self.total > 0 else None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Optional["BuildProgress"]:
        """The progress in one BuildLayerResponse or PushLayerEvent, or None (the final layer or result)."""
        if "progress" in d:
            return cls(message=d.get("progress") or "")
        st = d.get("status")
        if st is not None:
            return cls(stage=st.get("stage", ""), done=_int(st.get("done")), total=_int(st.get("total")), unit=st.get("unit", ""))
        return None


@dataclass
class TagResult:
    """What ``layers.tag()`` did: the layer the tag now names, and the digest
    it named before (``""`` for a new tag)."""

    layer: Layer
    previous_digest: str = ""

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TagResult":
        return cls(layer=Layer.from_json(d.get("layer") or {}), previous_digest=d.get("previousDigest", ""))


@dataclass
class PushResult:
    """What ``layers.push()`` did: the layer, the store it went to, and the
    bytes of image uploaded (0 if the store already had the image)."""

    layer: Layer
    store: str = ""
    uploaded_bytes: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "PushResult":
        return cls(layer=Layer.from_json(d.get("layer") or {}), store=d.get("store", ""), uploaded_bytes=_int(_get(d, "uploadedBytes", "uploaded_bytes")))


@dataclass
class RemoveResult:
    """What ``layers.rm()`` removed: tags, then images no longer used."""

    untagged: List[str]
    removed: List[Layer]
    freed_bytes: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RemoveResult":
        return cls(
            untagged=list(d.get("untagged") or []),
            removed=[Layer.from_json(x) for x in d.get("removed") or []],
            freed_bytes=_int(d.get("freedBytes")),
        )


@dataclass
class GCResult:
    """What ``layers.gc()`` removed (or, with ``dry_run``, would remove), and
    how many images it kept (tagged, named by an environment, used or mounted)."""

    removed: List[Layer]
    freed_bytes: int = 0
    kept: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "GCResult":
        return cls(
            removed=[Layer.from_json(x) for x in d.get("removed") or []],
            freed_bytes=_int(d.get("freedBytes")),
            kept=_int(d.get("kept")),
        )


@dataclass
class Environment:
    """A named stack of layers (a template): ``Sandbox.create(template=name)``.

    ``base``, ``workspaces`` and ``toolkits`` are the references as given;
    tags are resolved at each create, so moving a tag upgrades every later
    sandbox. ``resolved`` is what they name now, top to bottom (toolkits,
    workspaces, then the base); empty if one of them no longer resolves.
    """

    name: str
    base: str
    workspaces: List[str]
    toolkits: List[str]
    created_at: Optional[datetime]
    resolved: List[Layer] = field(default_factory=list)
    backend: str = ""  # its sandboxes' backend unless a create names one ("": the node's)
    revision: int = 0  # of its last write, on a cluster (etcd's); 0 on one server
    image: Optional["ImageConfig"] = None  # made from a pulled image: its config, the sandboxes' defaults
    tenant: str = ""  # whose it is; "" for a shared one (the admin's, read-only to tenants)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Environment":
        return cls(
            name=d.get("name", ""),
            base=d.get("base", ""),
            workspaces=list(d.get("workspaces") or []),
            toolkits=list(d.get("toolkits") or []),
            created_at=_time(d.get("createdAt")),
            resolved=[Layer.from_json(x) for x in d.get("resolved") or []],
            backend=d.get("backend", ""),
            revision=int(d.get("revision") or 0),
            image=ImageConfig.from_json(d["image"]) if d.get("image") is not None else None,
            tenant=d.get("tenant", ""),
        )


@dataclass
class ImageConfig:
    """What an OCI image says about its processes: the defaults of the
    sandboxes made from it (``env`` under the create's; ``working_dir`` and
    ``user`` for commands that give no ``cwd``/``user``). ``entrypoint`` and
    ``cmd`` are kept, not run."""

    env: List[str] = field(default_factory=list)  # KEY=VALUE
    working_dir: str = ""
    user: str = ""
    entrypoint: List[str] = field(default_factory=list)
    cmd: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ImageConfig":
        return cls(
            env=list(d.get("env") or []),
            working_dir=_get(d, "workingDir", "working_dir") or "",
            user=d.get("user", ""),
            entrypoint=list(d.get("entrypoint") or []),
            cmd=list(d.get("cmd") or []),
        )


@dataclass
class Image:
    """An image pulled from an OCI registry (``layers.pull_image()``): its
    layers, bottom first, each a layer of its own (``oci-base:sha256-<hex>``,
    then ``oci-layer:sha256-<hex>``), and its config. ``fetched_bytes`` and
    ``reused_layers`` are this pull's: bytes fetched from the registry, and
    layers the server had already (from any image)."""

    ref: str  # normalised: "index.docker.io/library/python:3.12"
    digest: str  # of its manifest (for an index: this platform's)
    platform: str
    layers: List[str]
    oci_layers: List[str]
    config: ImageConfig
    pulled_at: Optional[datetime] = None
    fetched_bytes: int = 0
    reused_layers: int = 0
    environment: Optional[Environment] = None  # saved, if asked for

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Image":
        env = d.get("environment")
        return cls(
            ref=d.get("ref", ""),
            digest=d.get("digest", ""),
            platform=d.get("platform", ""),
            layers=list(d.get("layers") or []),
            oci_layers=list(_get(d, "ociLayers", "oci_layers") or []),
            config=ImageConfig.from_json(d.get("config") or {}),
            pulled_at=_time(_get(d, "pulledAt", "pulled_at")),
            fetched_bytes=_int(_get(d, "fetchedBytes", "fetched_bytes")),
            reused_layers=_int(_get(d, "reusedLayers", "reused_layers")),
            environment=Environment.from_json(env) if env is not None else None,
        )
