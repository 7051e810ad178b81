"""Layers: the read-only, content-addressed EROFS images sandboxes are
composed from (one ``base``, any number of ``workspace`` and ``toolkit``
layers), on the server's node.

    from shoal import layers, Sandbox

    ws = layers.build("workspace", "repo:1", "./repo-tree", on_progress=print)   # uploaded
    layers.list()                               # tagged layers; all=True adds untagged images
    layers.get("repo:1").used_by_sandboxes      # who uses it (also .tags, .mounts)

    with Sandbox.create(base="debian:12", workspaces=["repo:1"]) as sb:
        sb.commands.run("cd /work/repo && make")
        built = sb.commit("workspace", "repo:1-built")   # what the sandbox changed, as a layer

    layers.tag("repo:1-built", "repo:latest")   # moves atomically
    layers.rm("repo:1")                         # LayerInUse while a sandbox or environment uses it
    layers.gc(dry_run=True)                     # images nothing references (the admin's key)
    layers.export("repo:latest", "repo.shoal-layer.tar")
    img = layers.pull_image("python:3.12", environment="py312")  # from its OCI registry
    Sandbox.create(template="py312")            # its layers; its Env, WORKDIR, USER
    layers.import_("repo.shoal-layer.tar", tag="repo:copy")

A reference is ``name:version`` (a tag, which can move), ``name@sha256:...``
or ``sha256:...`` (one image, which never changes). Tags and environments
belong to the key's tenant; the admin's are shared (``Layer.shared``),
read-only to tenants, and a name resolves to the tenant's own first, then
to the shared one; another tenant's is not found. The admin names a
tenant's as ``tenant/name:version``. ``build`` uploads its
source from this machine: a directory (as a tar made on the fly, owners,
modes, links and xattrs kept), or a file sent as it is: a tarball
(``.tar``, ``.tar.gz``, ``.tar.zst``), an OCI image layout as a tar or a
docker-archive. ``server_path=True`` names a path on the server instead,
allowed only inside the directories the server was given with
``--build-root``.
Environments (named stacks of layers, ``Sandbox.create(template=...)``) are
in :mod:`shoal.environments`.

Every function takes ``api_key=``, ``url=`` and ``request_timeout=`` like
``Sandbox.create``; ``abuild``, ``acommit``, ``alist``, ... are the asyncio
forms (``on_progress`` may then be a coroutine function).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
import base64
import inspect as _inspect
import json
import os
import subprocess
import tarfile
import threading
import time
from typing import IO, Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from ._protocol import FILE_CHUNK
from .exceptions import InvalidArgument, ServerError
from .models import BuildProgress, Environment, GCResult, Image, Layer, PushResult, RemoveResult, TagResult

__all__ = [
    "KINDS",
    "build",
    "commit",
    "list",
    "get",
    "inspect",
    "tag",
    "rm",
    "remove",
    "gc",
    "export",
    "import_",
    "push",
    "pull",
    "pull_image",
    "docker_credentials",
    "abuild",
    "acommit",
    "alist",
    "aget",
    "ainspect",
    "atag",
    "arm",
    "aremove",
    "agc",
    "aexport",
    "aimport_",
    "apush",
    "apull",
    "apull_image",
]

KINDS = ("base", "workspace", "toolkit")

ProgressCallback = Callable[[BuildProgress], Any]
PathArg = Union[str, "os.PathLike[str]"]
ImportSource = Union[PathArg, bytes, bytearray, memoryview, IO[bytes], Iterable[bytes]]

EXPORT_PATH = "/v1/layers/export"
IMPORT_PATH = "/v1/layers/import"
BUILD_PATH = "/v1/layers/build"
DOCKERFILE_PATH = "/v1/layers/dockerfile"


# --- requests, shared by the sync and asyncio forms ---


def _kind(kind: str, allowed: Iterable[str] = KINDS) -> str:
    k = kind.lower() if isinstance(kind, str) else ""
    if k.startswith("layer_kind_"):
        k = k[len("layer_kind_") :]
    allowed = tuple(allowed)
    if k not in allowed:
        raise InvalidArgument(f"layer kind {kind!r} must be one of {', '.join(allowed)}")
    return "LAYER_KIND_" + k.upper()


def _ref(ref: Any, what: str = "layer reference") -> str:
    if isinstance(ref, Layer):
        return ref.pinned
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"a {what} is required (name:version, name@sha256:... or sha256:...)")
    return ref


def _build_body(kind: str, ref: str, source: PathArg, compression: Optional[str], image: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"kind": _kind(kind), "ref": _ref(ref, "layer tag (name:version)"), "source": os.fspath(source)}
    if compression:
        body["compression"] = compression
    if image:
        body["image"] = image
    return body


def _upload_params(kind: str, ref: str, compression: Optional[str], image: Optional[str], desc: str) -> Dict[str, str]:
    params = {"kind": _kind(kind)[len("LAYER_KIND_") :].lower(), "ref": _ref(ref, "layer tag (name:version)")}
    if compression:
        params["compression"] = compression
    if image:
        params["image"] = image
    if desc:
        params["source"] = desc[:256]
    return params


def _write_tar(f: IO[bytes], root: str) -> None:
    """Write the tree under ``root`` to ``f`` as a PAX tar, as the Go SDK's
    WriteTar does: the root as ``./``, then every entry in lexical order,
    with mode (set-id bits too), numeric owner, mtime and xattrs
    (SCHILY.xattr records); symlinks not followed, files linked twice as
    hard links, device nodes and fifos as such (a build leaves the device
    nodes under /dev out, with a warning, and refuses the others).
    One file at a time; nothing of the tree is held in memory."""
    with tarfile.open(fileobj=f, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        stack = [(root, ".")]
        while stack:
            path, name = stack.pop()
            ti = tf.gettarinfo(path, arcname=name)
            if ti is None:
                raise InvalidArgument(f"{path} is a socket: a tar cannot hold it")
            if not ti.issym() and not ti.islnk():
                _add_xattrs(ti, path)
            if ti.isreg():
                with open(path, "rb") as src:
                    tf.addfile(ti, src)
            else:
                tf.addfile(ti)
            if ti.isdir():
                for n in sorted(os.listdir(path), reverse=True):  # popped in lexical order
                    stack.append((os.path.join(path, n), n if name == "." else name + "/" + n))


def _add_xattrs(ti: tarfile.TarInfo, path: str) -> None:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return  # a file system without xattrs
    for attr in names:
        try:
            v = os.getxattr(path, attr, follow_symlinks=False)
        except OSError:
            continue
        ti.pax_headers["SCHILY.xattr." + attr] = v.decode("utf-8", "surrogateescape")
        try:
            v.decode("utf-8")
        except UnicodeDecodeError:
            ti.pax_headers["hdrcharset"] = "BINARY"  # written back byte for byte


class _TarPipe:
    """A tar of a directory, written by a thread into a pipe and read here
    in chunks: the request body streams while the tree is read."""

    def __init__(self, root: str) -> None:
        self.r, w = os.pipe()
        self.error: Optional[BaseException] = None

        def writer() -> None:
            try:
                with os.fdopen(w, "wb") as f:
                    _write_tar(f, root)
            except BrokenPipeError:
                pass  # the reader stopped (the request ended first)
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                self.error = e

        self.thread = threading.Thread(target=writer, name="shoal-tar", daemon=True)
        self.thread.start()

    def read(self) -> bytes:
        return os.read(self.r, FILE_CHUNK)

    def close(self) -> None:
        if self.r >= 0:
            os.close(self.r)  # a writer still going gets EPIPE
            self.r = -1
        self.thread.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Uploaded:
    """Counts the bytes sent and reports them as the "upload" stage."""

    def __init__(self, on_progress: Optional[Callable[[BuildProgress], Any]], total: int) -> None:
        self.cb, self.total, self.n, self.last = on_progress, total, 0, 0.0

    def add(self, n: int, end: bool = False) -> Optional[BuildProgress]:
        self.n += n
        now = time.monotonic()
        if self.cb is None or (now - self.last < 0.1 and not end):
            return None
        self.last = now
        return BuildProgress(stage="upload", done=self.n, total=self.total, unit="bytes")


def _upload_source(source: Any) -> Tuple[str, Optional[str], int]:
    """(description, local path or None, size or 0) of a build source."""
    if _is_path(source):
        path = os.path.abspath(os.fspath(source))
        if not os.path.exists(path):
            raise FileNotFoundError(f"build source {path} does not exist (give server_path=True for a path on the server)")
        if os.path.isdir(path):
            return path, path, 0
        return path, None, os.path.getsize(path)
    return "", None, 0


def _sync_upload(source: Any, on_progress: Optional[ProgressCallback]) -> Iterator[bytes]:
    desc, tree, size = _upload_source(source)
    up = _Uploaded(on_progress, size)
    if on_progress is not None:
        on_progress(BuildProgress(message="uploading " + (desc or "the source")))
    if tree is not None:
        pipe = _TarPipe(tree)
        try:
            while True:
                b = pipe.read()
                if not b:
                    break
                p = up.add(len(b))
                if p is not None and on_progress is not None:
                    on_progress(p)
                yield b
        finally:
            pipe.close()
        pipe.check()
    else:
        c = _sync_content(source)()
        for b in [c] if isinstance(c, bytes) else c:
            p = up.add(len(b))
            if p is not None and on_progress is not None:
                on_progress(p)
            yield b
    p = up.add(0, end=True)
    if p is not None and on_progress is not None:
        on_progress(p)


def _commit_body(sandbox: Any, kind: str, ref: str, compression: Optional[str]) -> Dict[str, Any]:
    sandbox_id = sandbox if isinstance(sandbox, str) else getattr(sandbox, "sandbox_id", None)
    if not sandbox_id:
        raise InvalidArgument("commit needs a sandbox or a sandbox ID")
    body: Dict[str, Any] = {"sandboxId": sandbox_id, "kind": _kind(kind, ("workspace", "toolkit")), "ref": _ref(ref, "layer tag (name:version)")}
    if compression:
        body["compression"] = compression
    return body


def _long(request_timeout: Optional[float], t: Any) -> float:
    # Builds, commits and transfers move whole trees or images.
    return request_timeout if request_timeout is not None else max(600.0, t.config.request_timeout)


def _no_layer(what: str) -> ServerError:
    return ServerError(f"{what} stream ended without its result")


def _is_path(src: Any) -> bool:
    return isinstance(src, (str, os.PathLike))


def _file_chunks(path: PathArg) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while True:
            b = f.read(FILE_CHUNK)
            if not b:
                return
            yield b


def _sync_content(src: ImportSource) -> Callable[[], Union[bytes, Iterator[bytes]]]:
    """A maker of the request body for each attempt."""
    if _is_path(src):
        return lambda: _file_chunks(src)  # type: ignore[arg-type]
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        return lambda: data
    if hasattr(src, "read"):
        f = src

        def chunks() -> Iterator[bytes]:
            while True:
                b = f.read(FILE_CHUNK)  # type: ignore[union-attr]
                if not b:
                    return
                yield b

        return chunks
    if hasattr(src, "__iter__"):
        it = src
        return lambda: (bytes(b) for b in it)  # type: ignore[union-attr]
    raise InvalidArgument(f"import_ reads a path, bytes, a binary file object or an iterable of bytes, not {type(src).__name__}")


def _import_params(tag: Optional[str]) -> Dict[str, str]:
    return {"tag": _ref(tag, "tag")} if tag else {}


def _check_dest(dest: Any) -> None:
    if not _is_path(dest) and not hasattr(dest, "write"):
        raise InvalidArgument(f"export writes to a path or a binary file object, not {type(dest).__name__}")


# --- blocking ---


def _t(api_key: Optional[str], url: Optional[str]) -> Any:
    from ._sync.transport import transport_for

    return transport_for(api_key=api_key, url=url)


def _receive(stream: Iterator[Dict[str, Any]], on_progress: Optional[ProgressCallback], what: str, key: str = "layer", parse: Callable[[Dict[str, Any]], Any] = Layer.from_json) -> Any:
    # Read to the end of the stream (the result, msg[key], is the last
    # event), so the connection goes back to the pool and a trailing error
    # is not lost.
    layer: Any = None
    try:
        for msg in stream:
            if key in msg:
                layer = parse(msg[key] or {})
                continue
            p = BuildProgress.from_json(msg)
            if p is not None and on_progress is not None:
                on_progress(p)
    finally:
        close = getattr(stream, "close", None)  # if on_progress raised: the connection now, not at GC
        if close is not None:
            close()
    if layer is None:
        raise _no_layer(what)
    return layer


def build(
    kind: str,
    ref: str,
    source: Union[PathArg, ImportSource],
    *,
    compression: Optional[str] = None,
    image: Optional[str] = None,
    on_progress: Optional[ProgressCallback] = None,
    server_path: bool = False,
    push: bool = False,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Layer:
    """Build a layer and tag it ``ref``, uploading its source.

    :param kind: ``"base"``, ``"workspace"`` or ``"toolkit"``.
    :param ref: the tag, ``name:version``; an existing tag moves to the new image.
    :param source: a path on this machine: a directory (sent as a tar made
        on the fly, streamed: owners, modes, symlinks, hard links and xattrs
        kept, so the layer is the one a build of that directory on the
        server gives), or a file sent as it is: a ``.tar``/``.tar.gz``/
        ``.tar.zst`` of a tree, an OCI image layout as a tar, or a ``docker
        save`` archive. Bytes, a binary file object or an iterable of bytes
        are sent as such a file. With ``server_path=True``: an absolute path
        on the server's machine (also an OCI layout directory), read in
        place; the server allows only paths inside its ``--build-root``
        directories (else :class:`PermissionDenied`).
    :param compression: ``"none"``, ``"plain"`` (uncompressed, every file in
        whole blocks: a microVM's pmem layer reads all of it with DAX),
        ``"lz4"`` or ``"lz4hc"`` (server default if unset).
    :param image: for an image source holding several images, which one.
    :param on_progress: called with each :class:`BuildProgress`: a line per
        stage, and status updates (``done``/``total``) for a progress bar;
        an upload starts with an ``"upload"`` stage.
    :param push: then push it to the server's layer store (``shoal serve
        --layer-store``), as :func:`push` does, so every node resolves it.
    :returns: the :class:`Layer`, whose ``digest`` names exactly this image.
    """
    t = _t(api_key, url)
    if server_path:
        body = _build_body(kind, ref, source, compression, image)  # type: ignore[arg-type]
        layer = _receive(t.stream("LayerService", "BuildLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)), on_progress, "BuildLayer")
    else:
        params = _upload_params(kind, ref, compression, image, "")
        desc = _upload_source(source)[0]
        if desc:
            params["source"] = desc[:256]
        content = _sync_upload(source, on_progress)
        layer = _receive(t.post_ndjson(BUILD_PATH, params, content, what="layer build", content_type="application/x-tar", request_timeout=_long(request_timeout, t)), on_progress, "layer build")
    if push:
        t.call("LayerService", "PushLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=_long(request_timeout, t))
    return layer


@dataclass
class DockerfileResult:
    """A built Dockerfile: the environment saved (its stack, and the image
    config the Dockerfile set: ``environment.image``), its top layer (tagged
    ``name:version``), and how many steps made a layer now or found theirs
    in the cache."""

    environment: Environment
    layer: Layer
    steps_run: int = 0
    steps_cached: int = 0

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "DockerfileResult":
        return cls(
            environment=Environment.from_json(d.get("environment") or {}),
            layer=Layer.from_json(d.get("layer") or {}),
            steps_run=int(d.get("steps_run") or 0),
            steps_cached=int(d.get("steps_cached") or 0),
        )


def _dockerfile_params(
    context: PathArg, ref: str, dockerfile: Optional[PathArg], environment: Optional[str], build_args: Optional[Dict[str, str]],
    target: Optional[str], no_cache: bool, run_timeout: Optional[float], internet: bool, allow_out: Optional[List[str]],
) -> List[Tuple[str, str]]:  # fmt: skip
    ctx = os.path.abspath(os.fspath(context))
    if not os.path.isdir(ctx):
        raise InvalidArgument(f"build context {ctx} is not a directory")
    df = os.path.join(ctx, "Dockerfile") if dockerfile is None else os.path.abspath(os.fspath(dockerfile))
    rel = os.path.relpath(df, ctx)
    if rel.startswith("..") or os.path.isabs(rel):
        raise InvalidArgument(f"the Dockerfile {df} must be inside the build context {ctx}")
    params: List[Tuple[str, str]] = [("ref", _ref(ref, "result tag (name:version)")), ("dockerfile", rel.replace(os.sep, "/"))]
    if environment:
        params.append(("env", environment))
    if target:
        params.append(("target", target))
    if no_cache:
        params.append(("no_cache", "true"))
    if run_timeout is not None:
        params.append(("run_timeout", repr(float(run_timeout))))
    if internet:
        params.append(("internet", "true"))
    for c in allow_out or []:
        params.append(("allow_out", c))
    for k, v in (build_args or {}).items():
        params.append(("build_arg", f"{k}={v}"))
    return params


def build_dockerfile(
    context: PathArg,
    ref: str,
    *,
    dockerfile: Optional[PathArg] = None,
    environment: Optional[str] = None,
    build_args: Optional[Dict[str, str]] = None,
    target: Optional[str] = None,
    no_cache: bool = False,
    run_timeout: Optional[float] = None,
    internet: bool = False,
    allow_out: Optional[List[str]] = None,
    on_log: Optional[Callable[[Dict[str, Any]], Any]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> DockerfileResult:
    """Build a Dockerfile in sandboxes, as ``shoal layer build --dockerfile``:
    the directory ``context`` is uploaded as its build context (the server
    honours its ``.dockerignore``); ``RUN`` runs in a sandbox of the stack so
    far (no network unless ``internet``/``allow_out``), ``COPY``/``ADD`` copy
    from the context (or ``--from`` a stage), and each step's layer is cached,
    so a rebuild runs only the steps after a change. The result is saved as
    the environment ``environment`` (default: the name of ``ref``), with the
    Dockerfile's ENV, WORKDIR, USER, ENTRYPOINT and CMD as its image config;
    its top layer is tagged ``ref``.

    :param dockerfile: its path, inside ``context`` (default ``context/Dockerfile``).
    :param on_log: called with each line of the build log, a dict: a step
        starting (``step``, ``steps``, ``line``, ``text``, ``cached``), a note
        (``text``) or a RUN's output (``stream``, ``output``).
    :param run_timeout: seconds one RUN may take (server default 30 minutes).
    """
    params = _dockerfile_params(context, ref, dockerfile, environment, build_args, target, no_cache, run_timeout, internet, allow_out)
    t = _t(api_key, url)
    content = _sync_upload(os.fspath(context), None)
    stream = t.post_ndjson(DOCKERFILE_PATH, params, content, what="Dockerfile build", content_type="application/x-tar", request_timeout=_long(request_timeout, t))
    result: Optional[DockerfileResult] = None
    try:
        for msg in stream:
            if "result" in msg:
                result = DockerfileResult.from_json(msg["result"] or {})
            elif "log" in msg and on_log is not None:
                on_log(msg["log"] or {})
    finally:
        stream.close()
    if result is None:
        raise _no_layer("Dockerfile build")
    return result


def commit(
    sandbox: Any,
    kind: str,
    ref: str,
    *,
    compression: Optional[str] = None,
    on_progress: Optional[ProgressCallback] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Layer:
    """Turn what a sandbox changed (its writable layer) into a new layer.

    Stacked over the same layers, the new layer reproduces the sandbox's
    file system: deleted files become whiteouts. The sandbox keeps running.
    Same as ``sb.commit(kind, ref)``.

    :param sandbox: a :class:`~shoal.Sandbox` (its connection settings are
        used) or a sandbox ID.
    :param kind: ``"workspace"`` or ``"toolkit"``.
    :param ref: the tag, ``name:version``.
    """
    from ._sync.transport import Transport

    body = _commit_body(sandbox, kind, ref, compression)
    tr = getattr(sandbox, "_transport", None)
    t = tr if isinstance(tr, Transport) and api_key is None and url is None else _t(api_key, url)
    return _receive(t.stream("LayerService", "CommitLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)), on_progress, "CommitLayer")


def list(all: bool = False, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Layer]:  # noqa: A001
    """The node's layers, one entry per tag; with ``all``, also the images
    no tag points at (kept while a sandbox or environment uses them, or
    until :func:`gc`), with ``ref`` empty, and every entry's ``tags``."""
    r = _t(api_key, url).call("LayerService", "ListLayers", {"all": True} if all else {}, idempotent=True, request_timeout=request_timeout)
    return [Layer.from_json(x) for x in r.get("layers") or []]


def get(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Layer:
    """Resolve a reference, with who uses the image: ``tags``,
    ``used_by_sandboxes``, ``used_by_environments``, ``mounts``.
    Raises :class:`~shoal.LayerNotFound` if nothing has that name."""
    r = _t(api_key, url).call("LayerService", "GetLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=request_timeout)
    return Layer.from_json(r)


inspect = get  # the CLI's name


def tag(source: str, target: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> TagResult:
    """Point the tag ``target`` (``name:version``) at the image ``source``
    names, atomically: a create sees the old image or the new one, never
    neither. Sandboxes already running keep the image they started on."""
    body = {"source": _ref(source), "target": _ref(target, "tag (name:version)")}
    return TagResult.from_json(_t(api_key, url).call("LayerService", "TagLayer", body, idempotent=True, request_timeout=request_timeout))


def push(
    ref: str,
    store: Optional[str] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    on_progress: Optional[ProgressCallback] = None,
) -> PushResult:
    """Copy a layer of the server to its layer store (``shoal serve
    --layer-store URL``): the image and its chunk list unless the store has
    them, then the tag. ``store``, if given, must be that store's URL.

    :param on_progress: called with each :class:`BuildProgress` the server
        streams: a line per stage (``"upload"``, ``"chunks"``, ``"done"``)
        and byte counts (``done``/``total``) in between, the last of a
        stage equal to its total.
    """
    body = _push_body(ref, store)
    t = _t(api_key, url)
    if on_progress is None:
        return PushResult.from_json(t.call("LayerService", "PushLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)))
    stream = t.stream("LayerService", "PushLayerProgress", body, idempotent=True, request_timeout=_long(request_timeout, t))
    return _receive(stream, on_progress, "PushLayerProgress", "result", PushResult.from_json)


def _push_body(ref: str, store: Optional[str]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"ref": _ref(ref)}
    if store:
        body["store"] = store
    return body


def pull(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Layer:
    """Copy a layer whole from the server's layer store to the server and
    tag it there (a server with a store also runs layers it does not hold,
    from the store, without a pull)."""
    t = _t(api_key, url)
    return Layer.from_json(t.call("LayerService", "PullLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=_long(request_timeout, t)))


_DOCKER_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")


def _image_registry(image: str) -> str:
    """The registry of an image reference, as docker reads it ("docker.io"
    for a name without one)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def docker_credentials(image: str) -> List[Dict[str, str]]:
    """This machine's login for the registry of ``image``, as docker keeps
    it (``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``: its
    ``auths``, ``credHelpers`` and ``credsStore``), as the credentials of a
    pull request; ``[]`` when there is none. :func:`pull_image` sends them
    unless given ``credentials=``."""
    reg = _image_registry(image)
    path = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker"), "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return []
    keys = _DOCKER_HUB_KEYS if reg == "docker.io" else (reg, "https://" + reg, "http://" + reg)
    helper = next((cfg.get("credHelpers", {}).get(k) for k in keys if cfg.get("credHelpers", {}).get(k)), None) or cfg.get("credsStore")
    if helper:
        try:
            out = subprocess.run(["docker-credential-" + helper, "get"], input=keys[0], capture_output=True, text=True, timeout=30, check=True).stdout
            got = json.loads(out)
        except (OSError, subprocess.SubprocessError, ValueError):
            got = None
        if got and got.get("Secret"):
            if got.get("Username") == "<token>":
                return [{"registry": reg, "identityToken": got["Secret"]}]
            return [{"registry": reg, "username": got.get("Username", ""), "password": got["Secret"]}]
    for k in keys:
        a = cfg.get("auths", {}).get(k)
        if not a:
            continue
        cred = {"registry": reg}
        if a.get("auth"):
            user, _, pw = base64.b64decode(a["auth"]).decode().partition(":")
            cred.update(username=user, password=pw)
        for src, dst in (("username", "username"), ("password", "password"), ("identitytoken", "identityToken"), ("registrytoken", "registryToken")):
            if a.get(src):
                cred[dst] = a[src]
        if len(cred) > 1:
            return [cred]
    return []


def _pull_image_body(image: str, environment: Optional[str], replace: bool, credentials: Optional[List[Dict[str, str]]]) -> Dict[str, Any]:
    if not isinstance(image, str) or not image:
        raise InvalidArgument("image must be a non-empty string: [REGISTRY/]REPOSITORY[:TAG|@sha256:DIGEST]")
    body: Dict[str, Any] = {"image": image}
    creds = docker_credentials(image) if credentials is None else credentials
    if creds:
        body["credentials"] = creds
    if environment:
        body["environment"] = environment
    if replace:
        body["replace"] = True
    return body


def pull_image(
    image: str,
    environment: Optional[str] = None,
    replace: bool = False,
    credentials: Optional[List[Dict[str, str]]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    on_progress: Optional[ProgressCallback] = None,
) -> Image:
    """Pull an image from an OCI registry into the server's layers:
    ``[REGISTRY/]REPOSITORY[:TAG|@sha256:DIGEST]``, Docker Hub names as docker
    reads them (``python:3.12``), an index resolved to linux on the server's
    architecture. Each OCI layer becomes a layer of its own, fetched only if
    the server does not have it (from this image or any other).

    :param environment: also save the image as an environment of this name
        (``Sandbox.create(template=...)``), its Env, WorkingDir and User the
        defaults of its sandboxes (each create and command may override them).
    :param credentials: the registry logins to forward, ``[{"registry",
        "username", "password"}]`` (or ``identityToken``/``registryToken``);
        default: :func:`docker_credentials` of the image. Used for this pull
        only, never stored or logged by the server.
    :param on_progress: called with each :class:`BuildProgress`: a line per
        stage (``"fetch"`` of each OCI layer, then its conversion's) and byte
        counts in between.
    """
    t = _t(api_key, url)
    body = _pull_image_body(image, environment, replace, credentials)
    stream = t.stream("LayerService", "PullImage", body, idempotent=True, request_timeout=_long(request_timeout, t))
    return _receive(stream, on_progress, "PullImage", "image", Image.from_json)


def rm(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> RemoveResult:
    """Remove a tag, and its image if nothing else uses it (or an untagged
    image by digest). Raises :class:`~shoal.LayerInUse` for an image a
    sandbox or an environment uses (the tag is not removed either)."""
    r = _t(api_key, url).call("LayerService", "DeleteLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=request_timeout)
    return RemoveResult.from_json(r)


remove = rm


def gc(dry_run: bool = False, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> GCResult:
    """Remove every image no tag, environment or sandbox references and that
    is not mounted; with ``dry_run``, only say what would be removed."""
    r = _t(api_key, url).call("LayerService", "GarbageCollectLayers", {"dryRun": True} if dry_run else {}, idempotent=True, request_timeout=request_timeout)
    return GCResult.from_json(r)


def export(
    ref: str, dest: Union[PathArg, IO[bytes]], api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
) -> int:
    """Write a layer in the export format (a tar of its metadata and EROFS
    image) to ``dest``, a path or a binary file object; returns the bytes
    written. A path is written to a temporary name and renamed when
    complete, so it never holds a partial export. :func:`import_` (on this
    or another server) reads it back."""
    _check_dest(dest)
    t = _t(api_key, url)
    with t.get_stream(EXPORT_PATH, {"ref": _ref(ref)}, what=f"export of layer {ref}", request_timeout=_long(request_timeout, t)) as r:
        if not _is_path(dest):
            n = 0
            for chunk in r.iter_bytes(FILE_CHUNK):
                dest.write(chunk)  # type: ignore[union-attr]
                n += len(chunk)
            return n
        tmp = f"{os.fspath(dest)}.shoal-part"  # type: ignore[arg-type]
        try:
            n = 0
            with open(tmp, "wb") as f:
                for chunk in r.iter_bytes(FILE_CHUNK):
                    f.write(chunk)
                    n += len(chunk)
            os.replace(tmp, dest)  # type: ignore[arg-type]
            return n
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def import_(
    src: ImportSource, tag: Optional[str] = None, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
) -> Layer:
    """Store a layer sent in the export format (from :func:`export`): a
    path, bytes, a binary file object or an iterable of bytes, streamed.
    The server verifies the image's digest before storing it. ``tag``
    (``name:version``) replaces the tag recorded in the export. Retried
    like an idempotent call when the source can be read again (a path or bytes)."""
    content = _sync_content(src)
    t = _t(api_key, url)
    r = t.send_body(
        "POST", IMPORT_PATH, _import_params(tag), content, what="layer import", idempotent=_is_path(src) or isinstance(src, (bytes, bytearray, memoryview)),
        content_type="application/x-tar", request_timeout=_long(request_timeout, t),
    )  # fmt: skip
    return Layer.from_json(r)


# --- asyncio ---


def _at(api_key: Optional[str], url: Optional[str]) -> Any:
    from ._async.transport import transport_for

    return transport_for(api_key=api_key, url=url)


async def _call_back(cb: Optional[Callable[[Any], Any]], arg: Any) -> None:
    if cb is not None:
        x = cb(arg)
        if _inspect.isawaitable(x):
            await x


async def _areceive(
    stream: AsyncIterator[Dict[str, Any]],
    on_progress: Optional[Callable[[BuildProgress], Union[Any, Awaitable[Any]]]],
    what: str,
    key: str = "layer",
    parse: Callable[[Dict[str, Any]], Any] = Layer.from_json,
) -> Any:
    layer: Any = None
    try:
        async for msg in stream:  # to its end, as _receive
            if key in msg:
                layer = parse(msg[key] or {})
                continue
            p = BuildProgress.from_json(msg)
            if p is not None:
                await _call_back(on_progress, p)
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if layer is None:
        raise _no_layer(what)
    return layer


async def abuild(
    kind: str,
    ref: str,
    source: Union[PathArg, ImportSource],
    *,
    compression: Optional[str] = None,
    image: Optional[str] = None,
    on_progress: Optional[ProgressCallback] = None,
    server_path: bool = False,
    push: bool = False,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Layer:
    """:func:`build` for asyncio (the tree is read in a thread)."""
    t = _at(api_key, url)
    if server_path:
        body = _build_body(kind, ref, source, compression, image)  # type: ignore[arg-type]
        layer = await _areceive(t.stream("LayerService", "BuildLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)), on_progress, "BuildLayer")
    else:
        params = _upload_params(kind, ref, compression, image, "")
        desc = (await asyncio.to_thread(_upload_source, source))[0]
        if desc:
            params["source"] = desc[:256]
        content = _async_upload(source, on_progress)
        layer = await _areceive(
            t.post_ndjson(BUILD_PATH, params, content, what="layer build", content_type="application/x-tar", request_timeout=_long(request_timeout, t)), on_progress, "layer build"
        )
    if push:
        await t.call("LayerService", "PushLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=_long(request_timeout, t))
    return layer


async def abuild_dockerfile(
    context: PathArg,
    ref: str,
    *,
    dockerfile: Optional[PathArg] = None,
    environment: Optional[str] = None,
    build_args: Optional[Dict[str, str]] = None,
    target: Optional[str] = None,
    no_cache: bool = False,
    run_timeout: Optional[float] = None,
    internet: bool = False,
    allow_out: Optional[List[str]] = None,
    on_log: Optional[Callable[[Dict[str, Any]], Any]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> DockerfileResult:
    """:func:`build_dockerfile` for asyncio (``on_log`` may be a coroutine function)."""
    params = await asyncio.to_thread(_dockerfile_params, context, ref, dockerfile, environment, build_args, target, no_cache, run_timeout, internet, allow_out)
    t = _at(api_key, url)
    content = _async_upload(os.fspath(context), None)
    stream = t.post_ndjson(DOCKERFILE_PATH, params, content, what="Dockerfile build", content_type="application/x-tar", request_timeout=_long(request_timeout, t))
    result: Optional[DockerfileResult] = None
    try:
        async for msg in stream:
            if "result" in msg:
                result = DockerfileResult.from_json(msg["result"] or {})
            elif "log" in msg:
                await _call_back(on_log, msg["log"] or {})
    finally:
        await stream.aclose()
    if result is None:
        raise _no_layer("Dockerfile build")
    return result


async def _async_upload(source: Any, on_progress: Optional[Callable[[BuildProgress], Any]]) -> AsyncIterator[bytes]:
    desc, tree, size = await asyncio.to_thread(_upload_source, source)
    up = _Uploaded(on_progress, size)
    await _call_back(on_progress, BuildProgress(message="uploading " + (desc or "the source")))
    if tree is not None:
        pipe = _TarPipe(tree)
        try:
            while True:
                b = await asyncio.to_thread(pipe.read)
                if not b:
                    break
                p = up.add(len(b))
                if p is not None:
                    await _call_back(on_progress, p)
                yield b
        finally:
            await asyncio.to_thread(pipe.close)
        pipe.check()
    else:
        c = _async_content(source)()
        if isinstance(c, bytes):
            up.add(len(c))
            yield c
        else:
            async for b in c:
                p = up.add(len(b))
                if p is not None:
                    await _call_back(on_progress, p)
                yield b
    p = up.add(0, end=True)
    if p is not None:
        await _call_back(on_progress, p)


async def acommit(
    sandbox: Any,
    kind: str,
    ref: str,
    *,
    compression: Optional[str] = None,
    on_progress: Optional[ProgressCallback] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
) -> Layer:
    """:func:`commit` for asyncio (``sandbox`` is an :class:`~shoal.AsyncSandbox` or an ID)."""
    from ._async.transport import AsyncTransport

    body = _commit_body(sandbox, kind, ref, compression)
    tr = getattr(sandbox, "_transport", None)
    t = tr if isinstance(tr, AsyncTransport) and api_key is None and url is None else _at(api_key, url)
    return await _areceive(t.stream("LayerService", "CommitLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)), on_progress, "CommitLayer")


async def alist(all: bool = False, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> List[Layer]:
    """:func:`list` for asyncio."""
    r = await _at(api_key, url).call("LayerService", "ListLayers", {"all": True} if all else {}, idempotent=True, request_timeout=request_timeout)
    return [Layer.from_json(x) for x in r.get("layers") or []]


async def aget(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Layer:
    """:func:`get` for asyncio."""
    r = await _at(api_key, url).call("LayerService", "GetLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=request_timeout)
    return Layer.from_json(r)


ainspect = aget


async def atag(source: str, target: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> TagResult:
    """:func:`tag` for asyncio."""
    body = {"source": _ref(source), "target": _ref(target, "tag (name:version)")}
    return TagResult.from_json(await _at(api_key, url).call("LayerService", "TagLayer", body, idempotent=True, request_timeout=request_timeout))


async def apush(
    ref: str,
    store: Optional[str] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    on_progress: Optional[Callable[[BuildProgress], Union[Any, Awaitable[Any]]]] = None,
) -> PushResult:
    """:func:`push` for asyncio (``on_progress`` may be a coroutine function)."""
    body = _push_body(ref, store)
    t = _at(api_key, url)
    if on_progress is None:
        return PushResult.from_json(await t.call("LayerService", "PushLayer", body, idempotent=True, request_timeout=_long(request_timeout, t)))
    stream = t.stream("LayerService", "PushLayerProgress", body, idempotent=True, request_timeout=_long(request_timeout, t))
    return await _areceive(stream, on_progress, "PushLayerProgress", "result", PushResult.from_json)


async def apull(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> Layer:
    """:func:`pull` for asyncio."""
    t = _at(api_key, url)
    return Layer.from_json(await t.call("LayerService", "PullLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=_long(request_timeout, t)))


async def apull_image(
    image: str,
    environment: Optional[str] = None,
    replace: bool = False,
    credentials: Optional[List[Dict[str, str]]] = None,
    api_key: Optional[str] = None,
    url: Optional[str] = None,
    request_timeout: Optional[float] = None,
    on_progress: Optional[Callable[[BuildProgress], Union[Any, Awaitable[Any]]]] = None,
) -> Image:
    """:func:`pull_image` for asyncio (``on_progress`` may be a coroutine function)."""
    t = _at(api_key, url)
    body = await asyncio.to_thread(_pull_image_body, image, environment, replace, credentials)  # a credential helper may run
    stream = t.stream("LayerService", "PullImage", body, idempotent=True, request_timeout=_long(request_timeout, t))
    return await _areceive(stream, on_progress, "PullImage", "image", Image.from_json)


async def arm(ref: str, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> RemoveResult:
    """:func:`rm` for asyncio."""
    r = await _at(api_key, url).call("LayerService", "DeleteLayer", {"ref": _ref(ref)}, idempotent=True, request_timeout=request_timeout)
    return RemoveResult.from_json(r)


aremove = arm


async def agc(dry_run: bool = False, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None) -> GCResult:
    """:func:`gc` for asyncio."""
    r = await _at(api_key, url).call(
        "LayerService", "GarbageCollectLayers", {"dryRun": True} if dry_run else {}, idempotent=True, request_timeout=request_timeout
    )
    return GCResult.from_json(r)


async def aexport(
    ref: str, dest: Union[PathArg, IO[bytes]], api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
) -> int:
    """:func:`export` for asyncio (file writes run in a thread)."""
    _check_dest(dest)
    t = _at(api_key, url)
    async with t.get_stream(EXPORT_PATH, {"ref": _ref(ref)}, what=f"export of layer {ref}", request_timeout=_long(request_timeout, t)) as r:
        if not _is_path(dest):
            n = 0
            async for chunk in r.aiter_bytes(FILE_CHUNK):
                await asyncio.to_thread(dest.write, chunk)  # type: ignore[union-attr]
                n += len(chunk)
            return n
        tmp = f"{os.fspath(dest)}.shoal-part"  # type: ignore[arg-type]
        try:
            n = 0
            f = await asyncio.to_thread(open, tmp, "wb")
            try:
                async for chunk in r.aiter_bytes(FILE_CHUNK):
                    await asyncio.to_thread(f.write, chunk)
                    n += len(chunk)
            finally:
                await asyncio.to_thread(f.close)
            os.replace(tmp, dest)  # type: ignore[arg-type]
            return n
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _async_content(src: Any) -> Callable[[], Union[bytes, AsyncIterator[bytes]]]:
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        return lambda: data
    if _is_path(src) or hasattr(src, "read"):

        async def chunks() -> AsyncIterator[bytes]:
            f = await asyncio.to_thread(open, src, "rb") if _is_path(src) else src
            try:
                while True:
                    b = await asyncio.to_thread(f.read, FILE_CHUNK)
                    if not b:
                        return
                    yield b
            finally:
                if f is not src:
                    await asyncio.to_thread(f.close)

        return chunks
    if hasattr(src, "__aiter__"):

        async def from_async() -> AsyncIterator[bytes]:
            async for b in src:
                yield bytes(b)

        return from_async
    if hasattr(src, "__iter__"):

        async def from_sync() -> AsyncIterator[bytes]:
            for b in src:
                yield bytes(b)

        return from_sync
    raise InvalidArgument(f"aimport_ reads a path, bytes, a binary file object or an iterable of bytes, not {type(src).__name__}")


async def aimport_(
    src: ImportSource, tag: Optional[str] = None, api_key: Optional[str] = None, url: Optional[str] = None, request_timeout: Optional[float] = None
) -> Layer:
    """:func:`import_` for asyncio (also takes an async iterable of bytes)."""
    content = _async_content(src)
    t = _at(api_key, url)
    r = await t.send_body(
        "POST", IMPORT_PATH, _import_params(tag), content, what="layer import", idempotent=_is_path(src) or isinstance(src, (bytes, bytearray, memoryview)),
        content_type="application/x-tar", request_timeout=_long(request_timeout, t),
    )  # fmt: skip
    return Layer.from_json(r)
