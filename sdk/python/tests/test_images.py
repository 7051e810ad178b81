"""Images pulled from an OCI registry: a real registry server (Debian's
docker-registry, distribution 2.8) started by the test on a free port,
images pushed to it over the distribution protocol, pulled through the SDK
(sync and asyncio), and sandboxes made from them."""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from typing import Dict, Iterator, List, Tuple

import httpx
import pytest

import shoal
from shoal import layers

from .conftest import _busybox_rootfs, _free_port


@pytest.fixture
def registry(tmp_path) -> Iterator[str]:
    """host:port of a registry of the test's own."""
    exe = shutil.which("docker-registry")
    if exe is None:
        pytest.skip("needs docker-registry (apt-get install docker-registry)")
    host = f"127.0.0.1:{_free_port()}"
    cfg = tmp_path / "config.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\nhttp:\n  addr: {host}\n")
    with open(tmp_path / "registry.log", "w") as log:
        p = subprocess.Popen([exe, "serve", str(cfg)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://{host}/v2/", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the registry did not start: " + (tmp_path / "registry.log").read_text())
                time.sleep(0.05)
        yield host
    finally:
        p.kill()
        p.wait()


def _tar_gz(files: Dict[str, Tuple[bytes, int]], root: str = "") -> Tuple[bytes, str]:
    """A gzip'd tar of a directory (root) and files (path -> (data, mode));
    returns it and its diff ID (the sha256 of the tar)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        if root:
            for name in sorted(os.listdir(root)):
                tf.add(os.path.join(root, name), arcname=name)
        for path, (data, mode) in files.items():
            ti = tarfile.TarInfo(path)
            ti.size, ti.mode, ti.mtime = len(data), mode, 1700000000
            tf.addfile(ti, io.BytesIO(data))
    tar = raw.getvalue()
    return gzip.compress(tar, mtime=0), "sha256:" + hashlib.sha256(tar).hexdigest()


def _push(host: str, repo_tag: str, layer_blobs: List[Tuple[bytes, str]], config: Dict) -> str:
    """Push an image over the distribution protocol; returns its reference."""
    repo, tag = repo_tag.rsplit(":", 1)

    def blob(data: bytes) -> Dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        r = httpx.post(f"http://{host}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        loc = r.headers["location"]
        if loc.startswith("/"):
            loc = f"http://{host}{loc}"
        r = httpx.put(loc + ("&" if "?" in loc else "?") + "digest=" + digest, content=data, headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 201, r.text
        return {"digest": digest, "size": len(data)}

    cfg = {"architecture": "amd64", "os": "linux", "config": config, "rootfs": {"type": "layers", "diff_ids": [d for _, d in layer_blobs]}}
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": dict(blob(json.dumps(cfg).encode()), mediaType="application/vnd.oci.image.config.v1+json"),
        "layers": [dict(blob(b), mediaType="application/vnd.oci.image.layer.v1.tar+gzip") for b, _ in layer_blobs],
    }
    r = httpx.put(f"http://{host}/v2/{repo}/manifests/{tag}", content=json.dumps(manifest).encode(), headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text
    return f"{host}/{repo_tag}"


def test_pull_image(server, registry) -> None:
    if os.uname().machine not in ("x86_64", "amd64"):
        pytest.skip("the test's images are linux/amd64")
    rootfs = _busybox_rootfs()
    try:
        base = _tar_gz({}, rootfs)
    finally:
        shutil.rmtree(rootfs)
    tools = _tar_gz({"opt/bin/hello": (b"#!/bin/sh\necho hello from $PWD\n", 0o755)})
    config = {"Env": ["PATH=/opt/bin:/bin", "FROM_IMAGE=yes"], "WorkingDir": "/testbed", "User": "user", "Cmd": ["hello"]}
    refs = [_push(registry, f"sdk/task-{i}:1", [base, tools, _tar_gz({"testbed/TASK": (str(i).encode(), 0o644)})], config) for i in range(2)]

    seen: List[shoal.BuildProgress] = []
    img = layers.pull_image(refs[0], environment="sdk-img", on_progress=seen.append)
    assert len(img.layers) == 3 and img.reused_layers == 0 and img.fetched_bytes > 0
    assert img.layers[0].startswith("oci-base:sha256-") and img.layers[1].startswith("oci-layer:sha256-")
    assert img.config.working_dir == "/testbed" and img.config.user == "user" and img.config.cmd == ["hello"]
    assert img.environment is not None and img.environment.image is not None and img.environment.image.env == config["Env"]
    assert any(p.stage == "fetch" and p.total > 0 for p in seen), seen
    assert shoal.environments.get("sdk-img").image.working_dir == "/testbed"

    with shoal.Sandbox.create(template="sdk-img", timeout=120) as sb:
        r = sb.commands.run('echo "$(pwd) $(id -u) $FROM_IMAGE $(cat TASK)"; hello')
        assert r.stdout == "/testbed 1000 yes 0\nhello from /testbed\n", r
        r = sb.commands.run("pwd; id -u", cwd="/", user="root")  # overridden per command
        assert r.stdout == "/\n0\n"
        assert sb.info.image is not None and sb.info.image.cmd == ["hello"]
        r = sb.commands.run(" ".join(sb.info.image.entrypoint + sb.info.image.cmd))  # the image's command
        assert r.stdout == "hello from /testbed\n"

    # asyncio: the second image shares two layers; pulled again, nothing is fetched.
    async def pull_second() -> Tuple[shoal.Image, shoal.Image]:
        first = await layers.apull_image(refs[1])
        return first, await layers.apull_image(refs[1])

    second, again = asyncio.run(pull_second())
    assert second.reused_layers == 2 and second.layers[:2] == img.layers[:2]
    assert again.reused_layers == 3 and again.fetched_bytes == 0

    with pytest.raises(shoal.NotFound):
        layers.pull_image(f"{registry}/sdk/nothing:1")
    with pytest.raises(shoal.InvalidArgument):
        layers.pull_image("Not A Reference")
    shoal.environments.rm("sdk-img")


def test_docker_credentials(tmp_path, monkeypatch) -> None:
    auth = base64.b64encode(b"alice:s3cret").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {
        "reg.example:5000": {"auth": auth},
        "https://index.docker.io/v1/": {"username": "bob", "password": "hub"},
    }}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert layers.docker_credentials("reg.example:5000/team/app:1") == [{"registry": "reg.example:5000", "username": "alice", "password": "s3cret"}]
    assert layers.docker_credentials("python:3.12") == [{"registry": "docker.io", "username": "bob", "password": "hub"}]
    assert layers.docker_credentials("library/python") == [{"registry": "docker.io", "username": "bob", "password": "hub"}]
    assert layers.docker_credentials("ghcr.io/x/y") == []
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
    assert layers.docker_credentials("reg.example:5000/team/app:1") == []
