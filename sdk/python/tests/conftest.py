"""Fixtures: a real `shoal serve` on a free port with a short temporary data
directory and a busybox base layer, shared by the whole session.

Needs root, runc, mkfs.erofs and busybox(-static); without them every test
that needs the server skips with the reason (the unit tests still run).
Binaries come from $SHOAL_BIN_DIR (shoal and shoal-agent) or are built from
the repository with `go build`. SHOAL_SDK_KEEP=1 keeps the data directory;
SHOAL_SDK_STRICT=1 turns the skips of not-yet-implemented server features
(test_session_*.py) into failures.

SHOAL_SDK_CLUSTER=URL|KEY runs the suite against a running cluster's
control replica instead (test/cluster does, with the busybox base built on
every node): container sandboxes only; what a replica does not serve, or
what needs the one server's own files, skips saying so (CLUSTER_SKIP).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import httpx
import pytest

import shoal

REPO = Path(__file__).resolve().parents[3]
BASE = "busybox:1"
VM_IMAGE = os.environ.get("SHOAL_VM_IMAGE") or os.path.join(
    os.environ.get("SHOAL_TEST_CACHE", "/var/cache/shoal-test"), "fullvm", "fullvm.qcow2")
BACKENDS = ["container", "fncall", "microvm", "fullvm"]
STRICT = os.environ.get("SHOAL_SDK_STRICT") == "1"
CLUSTER = os.environ.get("SHOAL_SDK_CLUSTER", "")

# Through a control replica: what is not served there (or not the same), by
# test file or test name, with the reason.
CLUSTER_SKIP = {
    "test_upload_same_as_server_path": "builds from a path on the server: the nodes of this cluster have no build root",
    "test_tag_rm_in_use_and_gc": "the removal of an image by digest, gc and list(all=True) are each node's (a replica asks the nodes in turn, or one)",
    "test_build_list_inspect": "list(all=True) lists one node's images (the build may be on another)",
    "test_push_pull_layer_store": "a cluster's build pushes to the shared store already (a push uploads nothing), and a removed tag leaves etcd (it does not resolve from the store)",
    "test_environments": "a cluster's environments have etcd revisions (0 on one server)",
    "test_tenants.py": "needs the server's own data directory",
    "test_dockerfile.py": "Dockerfile builds are a single server's (a cluster's replicas do not route them)",
    "test_pull_image": "saving a pull as an environment is a single server's (in a cluster: env create --base IMAGE)",
    "test_install.py": "installs and runs a server of its own",
    "test_monitor.py": "needs the server's own process and data directory",
}


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if not CLUSTER:
        return
    for item in items:
        reason = CLUSTER_SKIP.get(item.path.name) or CLUSTER_SKIP.get(item.originalname if hasattr(item, "originalname") else item.name)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"through a control replica: {reason}"))


@dataclass
class Server:
    url: str
    api_key: str
    data_dir: str
    bin_dir: str
    base: str
    log: str
    build_root: str = ""  # serve --build-root: layers.build(..., server_path=True) reads below it

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = dict(os.environ, SHOAL_URL=self.url, SHOAL_API_KEY=self.api_key)
        return subprocess.run([os.path.join(self.bin_dir, "shoal"), *args], env=env, capture_output=True, text=True, check=check, timeout=300)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "".join(open(self.log, errors="replace").readlines()[-n:])
        except OSError:
            return ""


def _missing() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (runc, mounts, cgroups): run as root, as CI does"
    for b in ("runc", "mkfs.erofs", "busybox"):
        if not shutil.which(b):
            return f"needs {b} installed (apt-get install runc erofs-utils busybox-static)"
    if not os.environ.get("SHOAL_BIN_DIR") and not _go():
        return "needs Go to build shoal (or SHOAL_BIN_DIR with shoal and shoal-agent)"
    return None


def _go() -> Optional[str]:
    for g in (shutil.which("go"), "/usr/local/go/bin/go", "/usr/lib/go-1.23/bin/go"):
        if g and os.path.exists(g):
            return g
    return None


def _build(bin_dir: str) -> None:
    go = _go()
    env = dict(os.environ, GOTOOLCHAIN=os.environ.get("GOTOOLCHAIN", "auto"))
    subprocess.run([go, "build", "-o", os.path.join(bin_dir, "shoal"), "./cmd/shoal"], cwd=REPO, env=env, check=True, timeout=900)
    env["CGO_ENABLED"] = "0"
    subprocess.run([go, "build", "-o", os.path.join(bin_dir, "shoal-agent"), "./cmd/shoal-agent"], cwd=REPO, env=env, check=True, timeout=900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busybox_rootfs() -> str:
    root = tempfile.mkdtemp(prefix="sproot")
    for d in ("bin", "etc", "root", "tmp", "proc", "sys", "dev", "work", "www"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    shutil.copy(shutil.which("busybox"), os.path.join(root, "bin", "busybox"))  # type: ignore[arg-type]
    applets = subprocess.run([os.path.join(root, "bin", "busybox"), "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a != "busybox":
            os.symlink("busybox", os.path.join(root, "bin", a))
    files = {
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
        "etc/group": "root:x:0:\nnogroup:x:65534:\nuser:x:1000:\nusers:x:100:user\n",
        "www/index.html": "hello from the sandbox\n",
    }
    for p, content in files.items():
        with open(os.path.join(root, p), "w") as f:
            f.write(content)
    os.makedirs(os.path.join(root, "home", "user"))
    os.chown(os.path.join(root, "home", "user"), 1000, 1000)  # a user with a home, as E2B's templates have
    return root


def _unmount_under(d: str) -> None:
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4].startswith(d + "/"):
                mounts.append(fields[4])
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", m], capture_output=True)


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    reason = _missing()
    if reason:
        pytest.skip(reason)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")  # so the teardown below still runs

    signal.signal(signal.SIGTERM, on_term)
    if CLUSTER:
        yield from _cluster_server()
        return
    built = None
    bin_dir = os.environ.get("SHOAL_BIN_DIR")
    if not bin_dir:
        bin_dir = built = tempfile.mkdtemp(prefix="spbin")
        _build(bin_dir)
    data = tempfile.mkdtemp(prefix="sp", dir="/tmp")  # short: unix socket paths live under it
    build_root = tempfile.mkdtemp(prefix="spbuild")
    port = _free_port()
    log_path = os.path.join(data, "serve.log")
    log = open(log_path, "ab")
    # FnCall: a shell language on the busybox base (the built-in ones need debian:12).
    fncall_config = os.path.join(data, "fncall.json")
    with open(fncall_config, "w") as f:
        f.write('{"languages": [{"name": "sh", "base": "%s", "source": "main.sh", "run": ["sh", "main.sh", "{args}"]}]}' % BASE)
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "shoal"), "serve", "--data", data, "--listen", f"127.0.0.1:{port}",
         "--egress-subnet", "10.%d.0.0/16" % (248 + os.getpid() % 6), "--build-root", build_root,
         "--layer-store", "file://" + os.path.join(data, "layer-store")]
        # SHOAL_SDK_LAUNCHER=runc|native: the suite against either launcher (native: the default).
        + (["--launcher", os.environ["SHOAL_SDK_LAUNCHER"]] if os.environ.get("SHOAL_SDK_LAUNCHER") else [])
        # fullvm boots the Debian image the Go tests build and cache
        # (internal/backend/microvm), when there is one.
        + (["--vm-image", VM_IMAGE] if os.path.exists(VM_IMAGE) else []),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, SHOAL_FNCALL_CONFIG=fncall_config),
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    saved_env = {k: os.environ.get(k) for k in ("SHOAL_URL", "SHOAL_API_KEY")}
    srv = None
    try:
        for _ in range(400):
            if proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited with {proc.returncode}:\n{open(log_path).read()}")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError(f"shoal serve did not become healthy:\n{open(log_path).read()}")
        key = open(os.path.join(data, "admin.key")).read().strip()
        srv = Server(url=url, api_key=key, data_dir=data, bin_dir=bin_dir, base=BASE, log=log_path, build_root=build_root)
        rootfs = _busybox_rootfs()
        try:
            srv.cli("layer", "build", "--kind", "base", BASE, rootfs)
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
        # The SDK reads its configuration from the environment, as users' code does.
        os.environ["SHOAL_URL"], os.environ["SHOAL_API_KEY"] = url, key
        yield srv
    finally:
        if srv is not None:
            _kill_sandboxes(keep=set())
        _restore_env(saved_env)
        if request.session.testsfailed and srv is not None:
            print(f"\n--- last lines of {log_path} ---\n{srv.log_tail()}")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if os.environ.get("SHOAL_SDK_KEEP") == "1":
            print(f"kept {data}")
        else:
            _unmount_under(data)
            shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(build_root, ignore_errors=True)
        if built:
            shutil.rmtree(built, ignore_errors=True)


def _cluster_server() -> Iterator[Server]:
    """The control replica of a running cluster (SHOAL_SDK_CLUSTER=URL|KEY)."""
    url, key = CLUSTER.split("|", 1)
    saved_env = {k: os.environ.get(k) for k in ("SHOAL_URL", "SHOAL_API_KEY")}
    os.environ["SHOAL_URL"], os.environ["SHOAL_API_KEY"] = url, key
    before = {s.sandbox_id for s in shoal.Sandbox.list()}  # the cluster's own: left alone
    try:
        yield Server(url=url, api_key=key, data_dir="", bin_dir=os.environ.get("SHOAL_BIN_DIR", ""), base=BASE, log="")
    finally:
        _kill_sandboxes(keep=before)
        _restore_env(saved_env)


def _kill_sandboxes(keep: set) -> None:
    """Kill what the tests left (but the sandboxes in keep), then close the SDK's clients."""
    try:
        for s in shoal.Sandbox.list():
            if s.sandbox_id not in keep:
                shoal.Sandbox.kill(s.sandbox_id)
    except Exception:
        pass
    shoal.close()


def _restore_env(saved: Dict[str, Optional[str]]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_backend_skip: Dict[str, Optional[str]] = {}


def _create_timeout(backend: str) -> float:
    """A VM boots a kernel: under TCG on a loaded 2-core host, minutes."""
    return 300.0 if backend in ("microvm", "fullvm") else 60.0


def _probe_backend(server: Server, backend: str) -> Optional[str]:
    """None if the server can create sandboxes on `backend`, else its reason."""
    if backend not in _backend_skip:
        try:
            shoal.Sandbox.create(base=server.base, backend=backend, request_timeout=_create_timeout(backend)).kill()
            _backend_skip[backend] = None
        except (shoal.InvalidArgument, shoal.NotSupported, shoal.FailedPrecondition) as e:
            if backend == "container":
                raise
            _backend_skip[backend] = str(e)  # e.g. "backend "microvm" is not available on this node"
    return _backend_skip[backend]


# VM backends boot a kernel per sandbox (seconds under TCG, which CI
# machines without KVM use): they run this subset of the backend-parametrized
# tests (microvm: commands, files, lifecycle, pause, auto-pause, commit; fullvm, a full Debian
# system booting systemd: commands), the rest with SHOAL_SDK_VM_ALL=1.
VM_BACKENDS = ("microvm", "fullvm")
VM_SUBSET = {
    "microvm": {"test_exit_codes_stdout_stderr", "test_text_and_bytes", "test_connect_list_kill", "test_pause_resume", "test_auto_pause", "test_commit_backend"},
    "fullvm": {"test_exit_codes_stdout_stderr"},
}
VM_ALL = os.environ.get("SHOAL_SDK_VM_ALL") == "1"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, server: Server) -> str:
    """Each backend in turn; those the server does not offer skip with its reason."""
    if CLUSTER and request.param != "container":
        pytest.skip(f"backend {request.param}: the cluster run is of containers")
    if request.param in VM_BACKENDS and not VM_ALL and request.node.originalname not in VM_SUBSET[request.param]:
        pytest.skip(f"backend {request.param}: not in the VM subset (SHOAL_SDK_VM_ALL=1 runs it)")
    reason = _probe_backend(server, request.param)
    if reason:
        pytest.skip(f"backend {request.param}: {reason}")
    return request.param


@pytest.fixture
def sb(server: Server, backend: str) -> Iterator[shoal.Sandbox]:
    """A fresh sandbox on each backend, killed after the test."""
    s = shoal.Sandbox.create(base=server.base, backend=backend, timeout=600, request_timeout=_create_timeout(backend))
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture
def container_sb(server: Server) -> Iterator[shoal.Sandbox]:
    """A fresh container sandbox (for tests of the server API, not of a backend)."""
    s = shoal.Sandbox.create(base=server.base, timeout=600)
    try:
        yield s
    finally:
        s.kill()


def skip_unless_implemented(what: str, probe: Callable[[], object]) -> None:
    """Skip (or, with SHOAL_SDK_STRICT=1, fail) when the server answers a
    probe with `unimplemented`: the feature is being built server-side."""
    try:
        probe()
    except shoal.NotSupported as e:
        if STRICT:
            raise
        pytest.skip(f"server does not implement {what} yet: {e}")


def proto_has(field: str) -> bool:
    """Whether the wire definition in this repository declares `field`."""
    text = "".join(p.read_text() for p in (REPO / "api" / "shoal" / "v1").glob("*.proto"))
    return field in text


def skip_unless_proto(field: str, what: str) -> None:
    if not proto_has(field) and not STRICT:
        pytest.skip(f"{what}: api/shoal/v1 does not declare {field} yet")


def pytest_report_header(config: pytest.Config) -> List[str]:
    return [f"shoal SDK {shoal.__version__} from {Path(shoal.__file__).parent}"]
