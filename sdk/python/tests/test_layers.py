"""shoal.layers and shoal.environments against a real server: build from a
directory, list, inspect, commit a sandbox into a workspace and compose it,
tag, rm refused while in use, gc, environments as templates, export and
import. Layer names are unique to this module (the server is shared)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import tempfile
from typing import Dict, Iterator, List

import pytest

import shoal
from shoal import environments, layers

WORKSPACE_FILE = "/work/sdk/hello.txt"


def tree(files: Dict[str, str]) -> str:
    """A directory on this machine (uploaded by layers.build)."""
    root = tempfile.mkdtemp(prefix="sdklayer")
    for p, content in files.items():
        path = os.path.join(root, p)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
    return root


@pytest.fixture
def src(request: pytest.FixtureRequest) -> Iterator[str]:
    # Images are content-addressed: each test gets content of its own.
    d = tree({WORKSPACE_FILE.lstrip("/"): "hello from a layer\n", "work/sdk/sub/test": request.node.name})
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def read(sb: shoal.Sandbox, path: str) -> str:
    return sb.files.read(path)


def test_build_list_inspect(server, src) -> None:
    events: List[shoal.BuildProgress] = []
    l = layers.build("workspace", "sdk-ws:1", src, on_progress=events.append)
    assert (l.kind, l.ref, l.name, l.version) == ("workspace", "sdk-ws:1", "sdk-ws", "1")
    assert l.digest.startswith("sha256:") and l.size > 0 and l.files >= 4 and l.content_bytes == len("hello from a layer\n") + len("test_build_list_inspect")
    assert l.created_at is not None and src in l.source
    assert any(e.message for e in events), events  # a line per stage
    assert all(isinstance(e, shoal.BuildProgress) for e in events)

    listed = {x.ref: x for x in layers.list()}
    assert listed["sdk-ws:1"].digest == l.digest and listed[server.base].kind == "base"
    everything = layers.list(all=True)
    assert any(x.ref == "sdk-ws:1" and "sdk-ws:1" in x.tags for x in everything)

    got = layers.get("sdk-ws:1")
    assert got.digest == l.digest and got.tags == ["sdk-ws:1"] and not got.in_use
    assert layers.inspect(l.digest).digest == l.digest == layers.get(l.pinned).digest
    with pytest.raises(shoal.LayerNotFound):
        layers.get("sdk-nope:1")
    with pytest.raises(shoal.InvalidArgument, match="absolute"):
        layers.build("workspace", "sdk-ws:2", "relative/dir", server_path=True)
    with pytest.raises(FileNotFoundError):
        layers.build("workspace", "sdk-ws:2", "relative/dir")
    with pytest.raises(shoal.InvalidArgument):
        layers.build("workspace", "no-version", src)
    with pytest.raises(shoal.InvalidArgument):
        layers.build("rootfs", "sdk-ws:2", src)

    # The same content under another tag is the same image.
    assert layers.build("workspace", "sdk-ws:again", src).digest == l.digest
    r = layers.rm("sdk-ws:again")
    assert r.untagged == ["sdk-ws:again"] and r.removed == []  # sdk-ws:1 still names the image


def test_commit_and_compose(server, container_sb) -> None:
    sb = container_sb
    sb.files.write("/work/made/by-sandbox.txt", "made in a sandbox\n")
    sb.commands.run("rm /www/index.html", check=True)  # a deletion: a whiteout in the layer
    events: List[shoal.BuildProgress] = []
    l = sb.commit("workspace", "sdk-commit:1", on_progress=events.append)
    assert (l.kind, l.ref) == ("workspace", "sdk-commit:1") and f"sandbox {sb.sandbox_id}" in l.source and events
    assert sb.is_running()  # the sandbox keeps running
    with pytest.raises(shoal.InvalidArgument):
        sb.commit("base", "sdk-commit:2")

    for ws in ("sdk-commit:1", l):  # by tag, and a Layer (by digest)
        with shoal.Sandbox.create(base=server.base, workspaces=[ws], timeout=300) as sb2:
            assert read(sb2, "/work/made/by-sandbox.txt") == "made in a sandbox\n"
            assert not sb2.files.exists("/www/index.html")
            assert [(x.kind, x.digest) for x in sb2.get_info().layers][-1:] == [("base", layers.get(server.base).digest)]
            assert l.digest in [x.digest for x in sb2.info.layers]
    # The module form, by sandbox ID, as a toolkit.
    t = layers.commit(sb.sandbox_id, "toolkit", "sdk-commit-tk:1")
    assert t.kind == "toolkit" and t.digest == l.digest  # the same changes, the same image
    with pytest.raises(shoal.SandboxNotFound):
        layers.commit("nosuchsandbox", "workspace", "sdk-commit:3")
    layers.rm("sdk-commit-tk:1")


def test_commit_backend(server, backend, sb) -> None:
    """The same commit on every backend: a VM's writable layer is inside its
    guest (its agent sends it); the layer composes into a container."""
    sb.files.write("/work/made/in.txt", f"made in a {backend}\n")
    sb.commands.run("rm /www/index.html && rm -rf /work/sdk 2>/dev/null; mkdir -p /root && echo x > /root/y", check=True)
    l = sb.commit("workspace", f"sdk-commit-{backend}:1")
    assert l.kind == "workspace" and f"sandbox {sb.sandbox_id}" in l.source
    assert sb.is_running()
    assert sb.commands.run("cat /root/y", check=True).stdout == "x\n"  # its processes went on
    with shoal.Sandbox.create(base=server.base, workspaces=[l], timeout=300) as sb2:
        assert read(sb2, "/work/made/in.txt") == f"made in a {backend}\n"
        assert read(sb2, "/root/y") == "x\n"
        assert not sb2.files.exists("/www/index.html")  # the whiteout
    layers.rm(f"sdk-commit-{backend}:1")


def test_tag_rm_in_use_and_gc(server, src) -> None:
    a = layers.build("toolkit", "sdk-tgc:1", src)
    tagged = layers.tag("sdk-tgc:1", "sdk-tgc:stable")
    assert tagged.layer.digest == a.digest and tagged.previous_digest == ""
    with shoal.Sandbox.create(base=server.base, toolkits=["sdk-tgc:stable"], timeout=300) as sb:
        assert read(sb, WORKSPACE_FILE) == "hello from a layer\n"

        # A new version; the tag moves, the running sandbox keeps A.
        src_b = tree({WORKSPACE_FILE.lstrip("/"): "version B\n"})
        try:
            b = layers.build("toolkit", "sdk-tgc:1", src_b)
        finally:
            shutil.rmtree(src_b, ignore_errors=True)
        moved = layers.tag("sdk-tgc:1", "sdk-tgc:stable")
        assert moved.previous_digest == a.digest and moved.layer.digest == b.digest
        assert read(sb, WORKSPACE_FILE) == "hello from a layer\n"

        info = layers.get(a.digest)
        assert info.tags == [] and info.used_by_sandboxes == [sb.sandbox_id] and info.mounts >= 1 and info.in_use
        with pytest.raises(shoal.LayerInUse, match=sb.sandbox_id) as e:
            layers.rm(a.digest)
        assert isinstance(e.value, shoal.FailedPrecondition) and e.value.code == "failed_precondition"
        assert a.digest not in [x.digest for x in layers.gc().removed]
        assert any(x.digest == a.digest and x.ref == "" for x in layers.list(all=True))

    # Unused now: gc (a dry run first) collects A, keeps B (tagged).
    dry = layers.gc(dry_run=True)
    assert a.digest in [x.digest for x in dry.removed] and dry.freed_bytes >= a.size
    assert layers.get(a.digest).digest == a.digest  # a dry run removes nothing
    gc = layers.gc()
    assert a.digest in [x.digest for x in gc.removed] and b.digest not in [x.digest for x in gc.removed] and gc.kept >= 2
    with pytest.raises(shoal.LayerNotFound):
        layers.get(a.digest)

    # rm of one of two tags untags; of the last one removes the image.
    assert layers.rm("sdk-tgc:stable").untagged == ["sdk-tgc:stable"]
    last = layers.rm("sdk-tgc:1")
    assert last.untagged == ["sdk-tgc:1"] and [x.digest for x in last.removed] == [b.digest] and last.freed_bytes > 0


def test_environments(server, src) -> None:
    ws = layers.build("workspace", "sdk-envws:1", src)
    env = environments.create("sdk-env", base=server.base, workspaces=["sdk-envws:1"])
    assert (env.name, env.base, env.workspaces, env.toolkits) == ("sdk-env", server.base, ["sdk-envws:1"], [])
    assert [x.digest for x in env.resolved] == [ws.digest, layers.get(server.base).digest]
    assert "sdk-env" in [e.name for e in environments.list()]
    assert environments.get("sdk-env").created_at is not None
    with pytest.raises(shoal.AlreadyExists):
        environments.create("sdk-env", base=server.base)
    with pytest.raises(shoal.LayerNotFound):
        environments.create("sdk-env2", base=server.base, toolkits=["sdk-nope:1"])

    for template in ("sdk-env", env):  # a name, or the Environment
        with shoal.Sandbox.create(template=template, timeout=300) as sb:
            assert read(sb, WORKSPACE_FILE) == "hello from a layer\n"
            assert [x.digest for x in sb.info.layers] == [x.digest for x in env.resolved]
    # The environment names the tag: rm is refused, gc keeps the image.
    assert layers.get("sdk-envws:1").used_by_environments == ["sdk-env"]
    with pytest.raises(shoal.LayerInUse, match="sdk-env"):
        layers.rm("sdk-envws:1")

    # A backend of its own: its sandboxes run there unless a create names
    # one; a backend the node does not offer is refused.
    with pytest.raises(shoal.InvalidArgument, match="not available on this node|offered by no live node"):  # a node's / a cluster's
        environments.create("sdk-env-be", base=server.base, backend="nosuch")
    env_be = environments.create("sdk-env-be", base=server.base, backend="container")
    assert env_be.backend == "container" and environments.get("sdk-env-be").backend == "container"
    with shoal.Sandbox.create(template="sdk-env-be", timeout=60) as sb:
        assert sb.info.backend == "container"
    with shoal.Sandbox.create(template="sdk-env-be", backend="container", timeout=60) as sb:
        assert sb.info.backend == "container"
    environments.rm("sdk-env-be")

    replaced = environments.create("sdk-env", base=server.base, replace=True)
    assert replaced.workspaces == [] and len(replaced.resolved) == 1
    # Revisions are a cluster's (etcd's): one server has none.
    assert replaced.revision == 0
    with pytest.raises(shoal.InvalidArgument, match="cluster"):
        environments.create("sdk-env", base=server.base, replace=True, if_revision=5)
    environments.rm("sdk-env")
    with pytest.raises(shoal.NotFound):
        environments.get("sdk-env")
    with pytest.raises(shoal.NotFound):
        environments.rm("sdk-env")
    with pytest.raises(shoal.NotFound):
        shoal.Sandbox.create(template="sdk-env")
    layers.rm("sdk-envws:1")


def test_export_import_round_trip(server, src, tmp_path) -> None:
    l = layers.build("workspace", "sdk-xfer:1", src)
    path = tmp_path / "x.shoal-layer.tar"
    n = layers.export("sdk-xfer:1", path)
    assert n == path.stat().st_size > l.size and not os.path.exists(f"{path}.shoal-part")
    buf = io.BytesIO()
    assert layers.export(l.digest, buf) == n
    with pytest.raises(shoal.LayerNotFound):
        layers.export("sdk-nope:1", tmp_path / "nope.tar")
    assert not (tmp_path / "nope.tar").exists()

    # Gone from the server, then back from the file under another tag.
    assert [x.digest for x in layers.rm("sdk-xfer:1").removed] == [l.digest]
    imp = layers.import_(path, tag="sdk-xfer:imported")
    assert (imp.digest, imp.kind, imp.ref) == (l.digest, "workspace", "sdk-xfer:imported")
    with shoal.Sandbox.create(base=server.base, workspaces=["sdk-xfer:imported"], timeout=300) as sb:
        assert read(sb, WORKSPACE_FILE) == "hello from a layer\n"
    # From a file object and from bytes, under the tag recorded in the export.
    with open(path, "rb") as f:
        assert layers.import_(f).ref == "sdk-xfer:1"
    assert layers.import_(buf.getvalue(), tag="sdk-xfer:bytes").digest == l.digest
    # A damaged export is refused before anything is stored.
    bad = bytearray(buf.getvalue())
    bad[-2048] ^= 0xFF
    with pytest.raises(shoal.ShoalError) as e:
        layers.import_(bytes(bad[: len(bad) // 2]), tag="sdk-xfer:bad")
    assert isinstance(e.value, (shoal.InvalidArgument, shoal.FailedPrecondition)), repr(e.value)
    with pytest.raises(shoal.LayerNotFound):
        layers.get("sdk-xfer:bad")
    for t in ("sdk-xfer:imported", "sdk-xfer:1", "sdk-xfer:bytes"):
        layers.rm(t)


def test_asyncio(server, src) -> None:
    async def main() -> None:
        seen: List[shoal.BuildProgress] = []

        async def on_progress(p: shoal.BuildProgress) -> None:
            seen.append(p)

        l = await layers.abuild("workspace", "sdk-async:1", src, on_progress=on_progress)
        assert l.ref == "sdk-async:1" and seen
        assert "sdk-async:1" in [x.ref for x in await layers.alist()]
        assert (await layers.aget("sdk-async:1")).digest == l.digest
        await environments.acreate("sdk-aenv", base=server.base, workspaces=["sdk-async:1"])
        assert "sdk-aenv" in [e.name for e in await environments.alist()]
        async with await shoal.AsyncSandbox.create(template="sdk-aenv", timeout=300) as sb:
            assert await sb.files.read(WORKSPACE_FILE) == "hello from a layer\n"
            await sb.files.write("/work/sdk/async.txt", "async")
            c = await sb.commit("workspace", "sdk-async:2")
            assert c.kind == "workspace" and c.digest != l.digest
        await environments.arm("sdk-aenv")
        with pytest.raises(shoal.NotFound):
            await environments.aget("sdk-aenv")
        buf = io.BytesIO()
        n = await layers.aexport("sdk-async:2", buf)
        assert n > 0
        assert (await layers.arm("sdk-async:2")).removed
        imp = await layers.aimport_(buf.getvalue(), tag="sdk-async:3")
        assert imp.digest == c.digest
        assert (await layers.atag("sdk-async:3", "sdk-async:4")).layer.digest == c.digest
        for t in ("sdk-async:1", "sdk-async:3", "sdk-async:4"):
            await layers.arm(t)
        assert isinstance(await layers.agc(dry_run=True), shoal.GCResult)

    asyncio.run(main())


def _rich_tree(root: str) -> bool:
    """A tree with what an upload must carry; returns whether user.* xattrs were set."""
    os.makedirs(os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "etc"))
    os.makedirs(os.path.join(root, "empty"))
    with open(os.path.join(root, "bin", "tool"), "w") as f:
        f.write("#!/bin/sh\necho tool\n")
    with open(os.path.join(root, "etc", "conf"), "w") as f:
        f.write("a=1\n")
    os.chmod(os.path.join(root, "bin", "tool"), 0o4755)
    os.chmod(os.path.join(root, "empty"), 0o1733)
    os.link(os.path.join(root, "bin", "tool"), os.path.join(root, "bin", "tool-hardlink"))
    os.symlink("/etc/passwd", os.path.join(root, "etc", "passwd-link"))
    os.symlink("../bin/tool", os.path.join(root, "etc", "tool-link"))
    if os.geteuid() == 0:
        os.lchown(os.path.join(root, "etc", "conf"), 1234, 5678)
        os.lchown(os.path.join(root, "etc", "tool-link"), 99, 98)
    try:
        os.setxattr(os.path.join(root, "etc", "conf"), "user.shoal", b"v\x00\xff")
    except OSError:
        return False
    return True


def test_upload_same_as_server_path(server) -> None:
    """A directory uploaded by the SDK gives the image the server builds from
    the same directory read in place (inside its --build-root); a server
    path outside the build roots is refused, and a sandbox sees the upload."""
    root = tempfile.mkdtemp(prefix="tree", dir=server.build_root)
    try:
        xattrs = _rich_tree(root)
        events: List[shoal.BuildProgress] = []
        up = layers.build("toolkit", "sdk-up:1", root, on_progress=events.append)
        assert "upload" in up.source and root in up.source
        assert events[0].message == "uploading " + root and any(e.stage == "upload" for e in events)
        there = layers.build("toolkit", "sdk-up:server", root, server_path=True)
        assert there.digest == up.digest, (up.source, there.source)
        assert asyncio.run(layers.abuild("toolkit", "sdk-up:async", root)).digest == up.digest

        with shoal.Sandbox.create(base=server.base, toolkits=["sdk-up:1"]) as sb:
            r = sb.commands.run("stat -c '%a %u:%g %h' /bin/tool /etc/conf /empty && readlink /etc/passwd-link && /etc/tool-link")
            lines = r.stdout.splitlines()
            owner = "1234:5678" if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"
            assert lines[0].startswith("4755 ") and lines[0].endswith(" 2"), lines
            assert lines[1].split()[1] == owner and lines[2].startswith("1733 "), lines
            assert lines[3:] == ["/etc/passwd", "tool"], lines
        if not xattrs:
            print("no user.* xattrs on this file system: checked without them")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for path in ("/etc", os.path.join(server.data_dir, "admin.key")):
        with pytest.raises(shoal.PermissionDenied, match="--build-root"):
            layers.build("toolkit", "sdk-up:etc", path, server_path=True)
    link = os.path.join(server.build_root, "etc-link")
    os.symlink("/etc", link)
    try:
        with pytest.raises(shoal.PermissionDenied, match="not inside a build root"):
            layers.build("toolkit", "sdk-up:etc", link, server_path=True)
    finally:
        os.unlink(link)


def test_upload_file_and_bytes(server) -> None:
    """A tarball is sent as it is, from a path, bytes or a file object."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"from a tarball\n"
        ti = tarfile.TarInfo("work/tarball.txt")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    a = layers.build("workspace", "sdk-tgz:1", buf.getvalue())
    assert a.source.startswith("tar.gz upload")
    b = asyncio.run(layers.abuild("workspace", "sdk-tgz:2", io.BytesIO(buf.getvalue())))
    assert a.digest == b.digest
    with tempfile.NamedTemporaryFile(suffix=".tgz") as f:
        f.write(buf.getvalue())
        f.flush()
        assert layers.build("workspace", "sdk-tgz:3", f.name).digest == a.digest
    with pytest.raises(shoal.InvalidArgument, match="not a tar archive"):
        layers.build("workspace", "sdk-tgz:4", b"junk" * 100)


def test_push_pull_layer_store(server, src) -> None:
    """The test server runs with a file:// layer store: a pushed layer
    removed from the node still runs (mounted from the store), and pull
    brings it back whole."""
    l = layers.build("workspace", "sdk-store:1", src)
    events: list = []
    pushed = layers.push("sdk-store:1", on_progress=events.append)
    assert pushed.store.startswith("file://") and pushed.uploaded_bytes == l.size and pushed.layer.digest == l.digest
    # Streamed from the server: a line per stage, byte counts ending at the image's size.
    lines = [e.message for e in events if e.message]
    assert len(lines) == 3 and lines[0].startswith("uploading sdk-store:1") and lines[1].startswith("chunk list") and lines[2].startswith("pushed sdk-store:1"), lines
    uploads = [e for e in events if not e.message and e.stage == "upload"]
    assert uploads and uploads[-1].done == uploads[-1].total == l.size and uploads[-1].unit == "bytes", events
    assert [e.done for e in uploads] == sorted(e.done for e in uploads)
    assert layers.push("sdk-store:1").uploaded_bytes == 0  # the store has it
    again: list = []
    assert asyncio.run(layers.apush("sdk-store:1", on_progress=again.append)).uploaded_bytes == 0
    assert "already" in again[0].message and again[-1].message.startswith("pushed"), again
    # The CLI, its stderr not a terminal: the stage lines, the result as JSON on stdout.
    cli = subprocess.run([os.path.join(server.bin_dir, "shoal"), "layer", "push", "sdk-store:1"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, SHOAL_URL=server.url, SHOAL_API_KEY=server.api_key))
    assert cli.returncode == 0 and json.loads(cli.stdout)["layer"]["digest"] == l.digest and "has the image of sdk-store:1 already" in cli.stderr, cli
    with pytest.raises(shoal.InvalidArgument):
        layers.push("sdk-store:1", store="s3://elsewhere/x")

    layers.rm("sdk-store:1")
    from_store = layers.get("sdk-store:1")  # resolved from the store
    assert from_store.digest == l.digest and from_store.remote == pushed.store
    with shoal.Sandbox.create(base=server.base, workspaces=["sdk-store:1"], timeout=120) as sb:
        assert read(sb, WORKSPACE_FILE) == "hello from a layer\n"

    pulled = layers.pull("sdk-store:1")
    assert pulled.digest == l.digest and pulled.remote == ""
    assert "sdk-store:1" in layers.get("sdk-store:1").tags
    with pytest.raises(shoal.LayerNotFound):
        layers.pull("sdk-store:404")

    # Built and pushed in one call (sync and async): removed here, it
    # resolves from the store.
    for i, b in enumerate([lambda: layers.build("workspace", "sdk-store:2", src, push=True),
                           lambda: asyncio.run(layers.abuild("workspace", "sdk-store:3", src, push=True))]):
        built = b()
        ref = "sdk-store:%d" % (i + 2)
        layers.rm(ref)
        again = layers.get(ref)
        assert again.digest == built.digest
