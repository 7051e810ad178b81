"""Tests that need no server: the wire encoding, error mapping, retry
policy (against httpx's MockTransport), and sync/async surface parity."""

from __future__ import annotations

import asyncio
import inspect
import io
import os
import json
import struct
from typing import Any, List

import httpx
import pytest

import shoal
from shoal import _protocol as proto
from shoal._async.transport import AsyncTransport
from shoal._config import ConnectionConfig
from shoal._sync.transport import Transport

# --- envelopes ---


def env(flags: int, obj: Any) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">BI", flags, len(data)) + data


def test_envelope_roundtrip_in_any_split() -> None:
    stream = env(0, {"started": {"commandId": "c1", "pid": "7"}}) + env(0, {"stdout": "aGkK"}) + env(2, {})
    for split in range(1, len(stream)):
        dec = proto.EnvelopeDecoder()
        got = dec.feed(stream[:split]) + dec.feed(stream[split:])
        assert [f for f, _ in got] == [0, 0, 2]
        assert json.loads(got[1][1]) == {"stdout": "aGkK"}
        assert dec.pending == 0
    assert proto.envelope({"a": 1})[:5] == b"\x00\x00\x00\x00\x07"


def test_end_of_stream_error_becomes_exception() -> None:
    with pytest.raises(shoal.SandboxNotFound) as e:
        proto.decode_message(2, json.dumps({"error": {"code": "not_found", "message": '"x" is not a sandbox ID'}}).encode())
    assert e.value.code == "not_found" and "x" in str(e.value)
    with pytest.raises(proto.StreamEnd):
        proto.decode_message(2, b"{}")


@pytest.mark.parametrize(
    "code,message,kw,cls",
    [
        ("not_found", "agent stat /x: no such file or directory", {}, shoal.NotFound),
        ("not_found", "no sandbox abc on this node", {}, shoal.SandboxNotFound),
        ("not_found", "whatever", {"sandbox_call": True}, shoal.SandboxNotFound),
        ("not_found", "sandbox abc was killed (deleted) while command x ran: the command did not exit", {}, shoal.SandboxKilled),
        ("not_found", "gone", {"reason": "sandbox_killed"}, shoal.SandboxKilled),
        ("out_of_range", "pruned: re-attach from offset 42", {"reason": "log_pruned"}, shoal.LogPruned),
        ("out_of_range", "the output of command c before offset 7 was pruned ...: re-attach from offset 7", {}, shoal.LogPruned),
        ("out_of_range", "past the end", {}, shoal.InvalidArgument),
        ("invalid_argument", "bad", {}, shoal.InvalidArgument),
        ("unauthenticated", "invalid API key", {}, shoal.AuthError),
        ("resource_exhausted", "full", {}, shoal.CapacityExhausted),
        ("unavailable", "later", {}, shoal.Unavailable),
        ("deadline_exceeded", "slow", {}, shoal.Timeout),
        ("unimplemented", "no", {}, shoal.NotSupported),
        ("failed_precondition", "step 3 was recorded with another request", {"trajectory": True}, shoal.TrajectoryDiverged),
        ("failed_precondition", "x", {}, shoal.FailedPrecondition),
        ("internal", "boom", {}, shoal.ServerError),
        ("weird_new_code", "?", {}, shoal.ServerError),
    ],
)
def test_error_mapping(code: str, message: str, kw: Any, cls: type) -> None:
    e = shoal.exceptions.error_for(code, message, **kw)
    assert type(e) is cls and str(e) == message and e.code == code
    assert isinstance(e, shoal.ShoalError) and isinstance(e, shoal.SandboxException)


def test_killed_sandbox_from_stream_metadata() -> None:
    # The end of a command stream whose sandbox was deleted: NotFound, and
    # the reason in the end-of-stream metadata.
    end = {
        "error": {"code": "not_found", "message": "sandbox abcdefghijklmnopqrst was killed (deleted) while command c1 ran: the command did not exit"},
        "metadata": {"Shoal-Error-Reason": ["sandbox_killed"]},
    }
    with pytest.raises(shoal.SandboxKilled) as e:
        proto.decode_message(2, json.dumps(end).encode())
    assert isinstance(e.value, shoal.SandboxNotFound) and e.value.code == "not_found"
    assert e.value.sandbox_id == "abcdefghijklmnopqrst"
    # The reason alone is enough; a plain NotFound is not a killed sandbox.
    end = {"error": {"code": "not_found", "message": "gone"}, "metadata": {"shoal-error-reason": ["sandbox_killed"]}}
    with pytest.raises(shoal.SandboxKilled):
        proto.decode_message(2, json.dumps(end).encode())
    with pytest.raises(shoal.NotFound) as e2:
        proto.decode_message(2, json.dumps({"error": {"code": "not_found", "message": "no command x"}}).encode())
    assert not isinstance(e2.value, shoal.SandboxNotFound)
    # A unary call's reason comes in a header.
    h = proto.httpx.Headers({"Shoal-Error-Reason": "sandbox_killed"})
    e3 = proto.http_error(404, b'{"code":"not_found","message":"gone"}', reason=proto.metadata_reason(h))
    assert isinstance(e3, shoal.SandboxKilled)


def test_http_errors_without_connect_body() -> None:
    e = proto.http_error(404, b"404 page not found\n", what="SandboxService.PauseSandbox")
    assert isinstance(e, shoal.NotSupported) and "PauseSandbox" in str(e)
    assert isinstance(proto.http_error(502, b"bad gateway"), shoal.Unavailable)
    e = proto.http_error(401, b'{"code":"unauthenticated","message":"invalid API key"}')
    assert isinstance(e, shoal.AuthError) and e.status == 401 and str(e) == "invalid API key"


def test_e2b_exception_names() -> None:
    assert shoal.NotFoundException is shoal.NotFound
    assert shoal.TimeoutException is shoal.Timeout
    assert shoal.AuthenticationException is shoal.AuthError
    assert issubclass(shoal.CommandTimeout, shoal.CommandExitException)
    assert issubclass(shoal.CommandTimeout, shoal.Timeout)


# --- request bodies ---


@pytest.mark.parametrize(
    "v,want",
    [("512M", 512 << 20), ("1G", 1 << 30), ("1.5G", 3 << 29), ("64k", 64 << 10), ("2GiB", 2 << 30), (65536, 65536), ("100", 100), (None, None)],
)
def test_parse_memory(v: Any, want: Any) -> None:
    assert proto.parse_memory(v) == want


@pytest.mark.parametrize("v", ["lots", "-1G", "1X", True])
def test_parse_memory_refuses(v: Any) -> None:
    with pytest.raises(shoal.InvalidArgument):
        proto.parse_memory(v)


def test_create_body() -> None:
    b = proto.create_body(
        template=None, base="b:1", workspaces=["w:1"], toolkits=None, backend="container", cpus=0.5, memory="256M",
        timeout=90, metadata={"a": 1}, envs={"K": "V"}, qos=None, client_key="ck",
    )  # fmt: skip
    assert b == {
        "base": "b:1", "workspaces": ["w:1"], "backend": "container", "millicpu": "500", "memoryBytes": str(256 << 20),
        "timeoutSeconds": "90", "metadata": {"a": "1"}, "env": {"K": "V"}, "clientKey": "ck",
    }  # fmt: skip
    b = proto.create_body(
        template=None, base="b:1", workspaces=None, toolkits=None, backend=None, cpus=None, memory=None, disk="64M",
        log_budget="16M", timeout=None, metadata=None, envs=None, qos=None, client_key=None,
    )  # fmt: skip
    assert b == {"base": "b:1", "diskBytes": str(64 << 20), "logBudgetBytes": str(16 << 20)}
    assert shoal.exceptions.error_for("out_of_range", "x: re-attach from offset 42", reason="log_pruned").offset == 42
    with pytest.raises(shoal.InvalidArgument):
        proto.create_body(template=None, base="b", workspaces="w:1", toolkits=None, backend=None, cpus=None, memory=None, timeout=None, metadata=None, envs=None, qos=None, client_key=None)
    with pytest.raises(shoal.InvalidArgument):
        proto.create_body(template=None, base="b", workspaces=None, toolkits=None, backend=None, cpus=None, memory=None, timeout=None, metadata=None, envs=None, qos="fast", client_key=None)
    b = proto.create_body(template=None, base="b", workspaces=None, toolkits=None, backend=None, cpus=None, memory=None, timeout=None, metadata=None, envs=None, qos="be", client_key=None)
    assert b["qos"] == "be"


def test_argv_and_stdin() -> None:
    assert proto.argv("echo hi") == ["sh", "-c", "echo hi"]
    assert proto.argv(["a b", 1]) == ["a b", "1"]
    with pytest.raises(shoal.InvalidArgument):
        proto.argv([])
    assert proto.split_stdin(None) == (None, False, None)
    assert proto.split_stdin(True) == (None, True, None)
    assert proto.split_stdin("x") == (b"x", False, None)
    big = b"x" * (proto.INLINE_STDIN + 1)
    assert proto.split_stdin(big) == (None, True, big)


def test_command_state_decodes_split_utf8_and_offsets() -> None:
    st = proto.CommandState()
    st.feed({"started": {"commandId": "c", "pid": "3"}})
    euro = "€".encode()
    import base64

    outs: List[Any] = []
    outs += st.feed({"offset": "10", "stdout": base64.b64encode(euro[:1]).decode()})
    outs += st.feed({"offset": "12", "stdout": base64.b64encode(euro[1:] + b"\n").decode()})
    outs += st.feed({"offset": "20", "exit": {"code": 3}})
    assert "".join(o[0] for o in outs if o[0]) == "€\n"
    r = st.result()
    assert (r.exit_code, r.stdout, r.command_id, r.pid, st.offset) == (3, "€\n", "c", 3, 20)
    assert st.can_resume()
    with pytest.raises(shoal.CommandExitException) as e:
        proto.checked(r, True)
    assert e.value.exit_code == 3 and e.value.stdout == "€\n"
    assert proto.checked(r, False) is r


# --- retries, with a mock transport ---


def mock_transport(handler: Any, retries: int = 3) -> Transport:
    t = Transport(ConnectionConfig(url="http://shoal.test", api_key="k", retries=retries))
    t.client = httpx.Client(base_url="http://shoal.test", transport=httpx.MockTransport(handler))
    return t


def refusing(times: int, code: str = "resource_exhausted", status: int = 429) -> Any:
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) <= times:
            return httpx.Response(status, json={"code": code, "message": "node full"})
        return httpx.Response(200, json={"id": "sb1"})

    handler.calls = calls  # type: ignore[attr-defined]
    return handler


def test_idempotent_calls_are_retried_on_capacity_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proto, "backoff", lambda attempt, ra=None: 0)
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    h = refusing(2)
    assert mock_transport(h).call("SandboxService", "CreateSandbox", {"clientKey": "x"}, idempotent=True) == {"id": "sb1"}
    assert len(h.calls) == 3


def test_non_idempotent_calls_are_never_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    for code, status in (("resource_exhausted", 429), ("unavailable", 503)):
        h = refusing(1, code, status)
        with pytest.raises((shoal.CapacityExhausted, shoal.Unavailable)):
            mock_transport(h).call("CommandService", "SendStdin", {}, idempotent=False)
        assert len(h.calls) == 1


def test_retries_give_up_with_the_servers_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    h = refusing(100)
    with pytest.raises(shoal.CapacityExhausted, match="node full"):
        mock_transport(h, retries=2).call("SandboxService", "GetSandbox", {}, idempotent=True)
    assert len(h.calls) == 3


def test_lost_connections_are_retried_only_when_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=req)
        return httpx.Response(200, json={})

    assert mock_transport(handler).call("SandboxService", "DeleteSandbox", {}, idempotent=True) == {}
    calls.clear()
    with pytest.raises(shoal.ConnectionLost):
        mock_transport(handler).call("CommandService", "SendStdin", {}, idempotent=False)
    assert len(calls) == 1


def test_refused_connections_are_retried_always_then_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        raise httpx.ConnectError("connection refused", request=req)

    with pytest.raises(shoal.Unavailable, match="cannot connect"):
        mock_transport(handler, retries=2).call("CommandService", "SendStdin", {}, idempotent=False)
    assert len(calls) == 3  # a refused connection never reached the server


def test_stream_retried_before_first_message_only_when_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._sync.transport.backoff", lambda attempt, ra=None: 0)
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) == 1:
            return httpx.Response(200, stream=httpx.ByteStream(env(2, {"error": {"code": "unavailable", "message": "agent restarting"}})))
        return httpx.Response(200, stream=httpx.ByteStream(env(0, {"started": {"commandId": "c"}}) + env(2, {})))

    msgs = list(mock_transport(handler).stream("CommandService", "Exec", {"trajectoryId": "t", "step": "1"}, idempotent=True))
    assert msgs == [{"started": {"commandId": "c"}}] and len(calls) == 2
    calls.clear()
    with pytest.raises(shoal.Unavailable):
        list(mock_transport(handler).stream("CommandService", "Exec", {}, idempotent=False))
    assert len(calls) == 1


def test_async_transport_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal._async.transport.backoff", lambda attempt, ra=None: 0)
    h = refusing(2)

    async def main() -> Any:
        t = AsyncTransport(ConnectionConfig(url="http://shoal.test", api_key="k", retries=3))
        t.client = httpx.AsyncClient(base_url="http://shoal.test", transport=httpx.MockTransport(h))
        try:
            return await t.call("SandboxService", "CreateSandbox", {}, idempotent=True)
        finally:
            await t.aclose()

    assert asyncio.run(main()) == {"id": "sb1"}
    assert len(h.calls) == 3


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_URL", "http://example.test:1234/")
    monkeypatch.setenv("SHOAL_API_KEY", "sk_env")
    c = ConnectionConfig.resolve()
    assert (c.url, c.api_key) == ("http://example.test:1234", "sk_env")
    c = ConnectionConfig.resolve(url="http://other:1", api_key="sk_arg")
    assert (c.url, c.api_key) == ("http://other:1", "sk_arg")
    with pytest.raises(shoal.InvalidArgument):
        ConnectionConfig.resolve(url="localhost:7480")


# --- the sync and async surfaces are the same ---

PAIRS = [
    (shoal.Sandbox, shoal.AsyncSandbox),
    (shoal.Commands, shoal.AsyncCommands),
    (shoal.CommandHandle, shoal.AsyncCommandHandle),
    (shoal.Pty, shoal.AsyncPty),
    (shoal.Files, shoal.AsyncFiles),
    (shoal.WatchHandle, shoal.AsyncWatchHandle),
    (shoal.Trajectory, shoal.AsyncTrajectory),
    (shoal.Shells, shoal.AsyncShells),
    (shoal.Shell, shoal.AsyncShell),
]
# Where Python itself differs: iteration and context managers.
SYNC_ONLY = {"__iter__", "__enter__", "__exit__"}
ASYNC_ONLY = {"__aiter__", "__aenter__", "__aexit__"}


def public(cls: type) -> dict:
    out = {}
    for name in dir(cls):
        if name.startswith("_") and name not in SYNC_ONLY | ASYNC_ONLY | {"_kill_by_id", "_set_timeout_by_id", "_get_info_by_id"}:
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            out[name] = "property"
        elif callable(attr) or isinstance(attr, (classmethod, staticmethod)):
            fn = getattr(cls, name)
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                sig = None
            out[name] = [(p.name, p.kind, p.default) for p in sig.parameters.values()] if sig else "callable"
    return out


@pytest.mark.parametrize("sync_cls,async_cls", PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_sync_and_async_surfaces_match(sync_cls: type, async_cls: type) -> None:
    s, a = public(sync_cls), public(async_cls)
    assert set(s) - SYNC_ONLY == set(a) - ASYNC_ONLY
    for name in set(s) - SYNC_ONLY:
        if name in ("__init__",):
            continue
        assert s[name] == a[name], f"{sync_cls.__name__}.{name} differs from {async_cls.__name__}.{name}"


def test_e2b_names_are_there() -> None:
    for name in ("create", "connect", "list", "kill", "set_timeout", "get_info", "is_running", "get_host", "pause", "resume"):
        assert hasattr(shoal.Sandbox, name), name
    for name in ("run", "connect", "list", "kill", "send_stdin"):
        assert hasattr(shoal.Commands, name), name
    for name in ("read", "write", "list", "exists", "get_info", "remove", "rename", "make_dir", "watch_dir"):
        assert hasattr(shoal.Files, name), name
    for name in ("wait", "kill", "send_stdin", "disconnect", "pid"):
        assert hasattr(shoal.CommandHandle, name), name
    run = inspect.signature(shoal.Commands.run).parameters
    assert list(run)[1:11] == ["cmd", "background", "envs", "user", "cwd", "on_stdout", "on_stderr", "stdin", "timeout", "request_timeout"]
    assert run["timeout"].default == 60
    assert list(inspect.signature(shoal.Sandbox.create).parameters)[:4] == ["template", "timeout", "metadata", "envs"]


def test_kill_works_on_the_class_and_the_instance() -> None:
    assert inspect.ismethod(shoal.Sandbox.kill) and shoal.Sandbox.kill.__self__ is shoal.Sandbox
    sb = shoal.Sandbox(shoal.SandboxInfo.from_json({"id": "x"}), mock_transport(lambda r: httpx.Response(200, json={})))
    assert sb.kill.__self__ is sb and sb.kill() is True


def test_models_parse_protojson() -> None:
    info = shoal.SandboxInfo.from_json(
        {
            "id": "abc", "backend": "container", "state": "SANDBOX_STATE_RUNNING", "memoryBytes": "268435456", "millicpu": "500",
            "pidsLimit": "1024", "timeoutSeconds": "1800", "createdAt": "2026-11-29T14:48:33.402316420Z", "metadata": {"a": "b"},
            "layers": [{"kind": "LAYER_KIND_BASE", "ref": "busybox:1", "digest": "sha256:00"}],
        }
    )  # fmt: skip
    assert (info.state, info.memory_mb, info.cpus, info.timeout, info.layers[0].kind) == ("running", 256, 0.5, 1800, "base")
    assert info.created_at is not None and info.created_at.microsecond == 402316
    e = shoal.EntryInfo.from_json({"name": "d", "path": "/w/d", "isDir": True, "mode": 493, "size": "4096"})
    assert e.type == shoal.FileType.DIR and e.permissions == "rwxr-xr-x" and e.size == 4096
    ev = shoal.FilesystemEvent.from_json({"op": "OP_CREATE", "path": "/w/a/b.txt"}, "/w")
    assert (ev.name, ev.type) == ("a/b.txt", shoal.FilesystemEventType.CREATE)


def test_fncall_sync_and_async_match() -> None:
    from shoal import fncall

    for s, a in ((fncall.run, fncall.arun), (fncall.run_batch, fncall.arun_batch), (fncall.languages, fncall.alanguages)):
        assert inspect.signature(s).parameters.keys() == inspect.signature(a).parameters.keys()
        assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s)
    body = fncall.request("python", "print(1)", tests=[("1", "2"), "3", {"stdin": "4", "compare": "float"}], limits={"memory": "64M", "cpu_time_ms": 500})
    assert body["tests"] == [{"stdin": "1", "expected": "2"}, {"stdin": "3"}, {"stdin": "4", "compare": "COMPARE_FLOAT"}]
    assert body["limits"] == {"cpuTimeMs": "500", "memoryBytes": str(64 << 20)}
    with pytest.raises(shoal.InvalidArgument):
        fncall.request("python", "x", stdin="a", tests=["b"])


# --- layers and environments ---

LAYER_FNS = ["build", "commit", "list", "get", "inspect", "tag", "rm", "remove", "gc", "export", "import_"]
ENV_FNS = ["create", "list", "get", "rm", "remove"]


@pytest.mark.parametrize("mod,names", [(shoal.layers, LAYER_FNS), (shoal.environments, ENV_FNS)], ids=["layers", "environments"])
def test_layers_and_environments_sync_and_async_match(mod: Any, names: List[str]) -> None:
    for n in names:
        s, a = getattr(mod, n), getattr(mod, "a" + n)
        assert n in mod.__all__ and "a" + n in mod.__all__
        assert inspect.signature(s).parameters.keys() == inspect.signature(a).parameters.keys(), n
        assert inspect.iscoroutinefunction(a) and not inspect.iscoroutinefunction(s), n
        assert s.__doc__ and a.__doc__, n


def test_layer_models_parse_protojson() -> None:
    d = {
        "name": "repo", "version": "1", "kind": "LAYER_KIND_WORKSPACE", "digest": "sha256:ab", "size": "4096", "compression": "lz4",
        "createdAt": "2026-11-29T14:48:33Z", "ref": "repo:1", "source": "dir /src", "files": "3", "contentBytes": "12",
        "tags": ["repo:1", "repo:latest"], "usedBySandboxes": ["sb1"], "mounts": 1,
    }  # fmt: skip
    l = shoal.Layer.from_json(d)
    assert (l.kind, l.size, l.files, l.content_bytes, l.tags, l.used_by_sandboxes, l.mounts) == ("workspace", 4096, 3, 12, ["repo:1", "repo:latest"], ["sb1"], 1)
    assert l.pinned == "repo@sha256:ab" and l.in_use and l.created_at is not None
    # The import endpoint replies with proto names.
    l2 = shoal.Layer.from_json({"name": "r", "kind": "LAYER_KIND_TOOLKIT", "digest": "sha256:cd", "content_bytes": "7", "created_at": "2026-11-29T14:48:33Z"})
    assert (l2.kind, l2.content_bytes, l2.created_at is not None, l2.in_use) == ("toolkit", 7, True, False)
    assert shoal.Layer.from_json({"digest": "sha256:ef"}).pinned == "sha256:ef"
    p = shoal.BuildProgress.from_json({"status": {"stage": "mkfs", "done": "5", "total": "10", "unit": "files"}})
    assert p is not None and (p.message, p.stage, p.fraction) == ("", "mkfs", 0.5)
    p = shoal.BuildProgress.from_json({"progress": "scanning /src"})
    assert p is not None and p.message == "scanning /src" and p.fraction is None
    assert shoal.BuildProgress.from_json({"layer": d}) is None
    e = shoal.Environment.from_json({"name": "t", "base": "b:1", "workspaces": ["w:1"], "resolved": [d, d]})
    assert (e.name, e.base, e.workspaces, e.toolkits, len(e.resolved)) == ("t", "b:1", ["w:1"], [], 2)
    # Tenants own layers and environments; the admin's are shared.
    assert l.shared and l.tenant == "" and e.tenant == ""
    mine = shoal.Layer.from_json({**d, "tenant": "acme"})
    assert (mine.tenant, mine.shared) == ("acme", False)
    assert shoal.Environment.from_json({"name": "t", "base": "b:1", "tenant": "acme"}).tenant == "acme"
    r = shoal.RemoveResult.from_json({"untagged": ["repo:1"], "removed": [d], "freedBytes": "4096"})
    assert (r.untagged, r.removed[0].digest, r.freed_bytes) == (["repo:1"], "sha256:ab", 4096)
    g = shoal.GCResult.from_json({"kept": 2})
    assert (g.removed, g.freed_bytes, g.kept) == ([], 0, 2)
    t = shoal.TagResult.from_json({"layer": d, "previousDigest": "sha256:00"})
    assert (t.layer.ref, t.previous_digest) == ("repo:1", "sha256:00")


@pytest.mark.parametrize(
    "code,message,cls",
    [
        ("failed_precondition", "remove layer sha256:ab: layer in use: used by sandbox sb1", shoal.LayerInUse),
        ("not_found", "resolve layer nope:1: layer not found", shoal.LayerNotFound),
        ("not_found", "no sandbox x on this node", shoal.SandboxNotFound),
        ("not_found", 'no environment "e" (see shoal env ls)', shoal.NotFound),
    ],
)
def test_layer_error_mapping(code: str, message: str, cls: type) -> None:
    e = shoal.exceptions.error_for(code, message)
    assert type(e) is cls
    assert isinstance(shoal.LayerInUse("x"), shoal.FailedPrecondition) and isinstance(shoal.LayerNotFound("x"), shoal.NotFound)


def test_layer_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: List[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        if req.url.path == "/shoal.v1.LayerService/BuildLayer":
            body = env(0, {"progress": "copying"}) + env(0, {"status": {"stage": "copy", "done": "1", "total": "2", "unit": "files"}})
            body += env(0, {"layer": {"name": "w", "version": "1", "kind": "LAYER_KIND_WORKSPACE", "digest": "sha256:ab"}}) + env(2, {})
            return httpx.Response(200, stream=httpx.ByteStream(body), headers={"Content-Type": "application/connect+json"})
        if req.url.path == "/v1/layers/build":
            body = json.dumps({"progress": "extracting"}) + "\n" + json.dumps({"status": {"stage": "extract", "done": "1", "total": "4", "unit": "bytes"}}) + "\n"
            if req.url.params["ref"] == "bad:1":
                body += json.dumps({"error": {"code": "invalid_argument", "message": "not a tar archive"}}) + "\n"
            else:
                body += json.dumps({"layer": {"name": "u", "version": "1", "kind": "LAYER_KIND_TOOLKIT", "digest": "sha256:cd"}}) + "\n"
            return httpx.Response(200, stream=httpx.ByteStream(body.encode()), headers={"Content-Type": "application/x-ndjson"})
        if req.url.path == "/v1/layers/export":
            return httpx.Response(200, stream=httpx.ByteStream(b"TAR" * 1000))
        if req.url.path == "/v1/layers/import":
            assert req.read() == b"TAR" * 1000
            return httpx.Response(200, json={"name": "w", "version": "2", "kind": "LAYER_KIND_WORKSPACE", "digest": "sha256:ab"})
        return httpx.Response(200, json={})

    t = mock_transport(handler)
    monkeypatch.setattr("shoal._sync.transport.transport_for", lambda **kw: t)
    events: List[shoal.BuildProgress] = []
    l = shoal.layers.build("workspace", "w:1", "/src", compression="lz4", on_progress=events.append, server_path=True)
    assert l.pinned == "w@sha256:ab" and [e.message for e in events] == ["copying", ""] and events[1].fraction == 0.5
    assert json.loads(seen[-1].content[5:]) == {"kind": "LAYER_KIND_WORKSPACE", "ref": "w:1", "source": "/src", "compression": "lz4"}
    # Uploads: a directory goes as a tar (read back here), the reply is NDJSON.
    import tarfile
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        os.makedirs(os.path.join(d, "sub"))
        with open(os.path.join(d, "sub", "f"), "w") as f:
            f.write("hello")
        os.symlink("/etc/passwd", os.path.join(d, "ln"))
        events.clear()
        u = shoal.layers.build("toolkit", "u:1", d, on_progress=events.append)
        assert u.pinned == "u@sha256:cd" and events[0].message == "uploading " + d and "extracting" in [e.message for e in events]
        assert dict(seen[-1].url.params) == {"kind": "toolkit", "ref": "u:1", "source": d}
        tf = tarfile.open(fileobj=io.BytesIO(seen[-1].read()))
        got = {m.name: (m.type, m.linkname) for m in tf.getmembers()}
        assert got == {".": (tarfile.DIRTYPE, ""), "ln": (tarfile.SYMTYPE, "/etc/passwd"), "sub": (tarfile.DIRTYPE, ""), "sub/f": (tarfile.REGTYPE, "")}, got
        with pytest.raises(shoal.InvalidArgument, match="not a tar archive"):
            shoal.layers.build("toolkit", "bad:1", b"junk")
    shoal.layers.gc(dry_run=True)
    assert json.loads(seen[-1].content) == {"dryRun": True}
    buf = io.BytesIO()
    assert shoal.layers.export("w:1", buf) == 3000 and seen[-1].url.params["ref"] == "w:1"
    assert shoal.layers.import_(buf.getvalue(), tag="w:2").ref == "" and seen[-1].url.params["tag"] == "w:2"
    assert shoal.layers.import_(iter([b"TAR" * 500, b"TAR" * 500])).version == "2"
    with pytest.raises(shoal.InvalidArgument):
        shoal.layers.build("rootfs", "w:1", "/src")
    with pytest.raises(shoal.InvalidArgument):
        shoal.layers.commit("sb1", "base", "w:1")
    with pytest.raises(shoal.InvalidArgument):
        shoal.layers.export("w:1", 42)  # type: ignore[arg-type]
    with pytest.raises(shoal.InvalidArgument):
        shoal.environments.create("e", base="b:1", workspaces="w:1")
    with pytest.raises(shoal.InvalidArgument, match="for a replace"):
        shoal.environments.create("e", base="b:1", if_revision=3)
    assert shoal.Environment.from_json({"name": "e", "revision": "42"}).revision == 42
    body = proto.create_body(
        template=shoal.Environment.from_json({"name": "tmpl"}), base=l, workspaces=["x:1", l], toolkits=None, backend=None,
        cpus=None, memory=None, timeout=None, metadata=None, envs=None, qos=None, client_key=None,
    )  # fmt: skip
    assert body == {"template": "tmpl", "base": "w@sha256:ab", "workspaces": ["x:1", "w@sha256:ab"]}


def test_monitor_status_of_a_cluster() -> None:
    from shoal import monitor

    st = monitor.Status.from_json({
        "time": "2026-12-01T10:00:00Z",
        "nodes": [{"name": "n1", "state": "up", "heartbeatAt": "2026-12-01T09:59:58.5Z", "url": "http://10.0.0.1:7480", "cpus": 2},
                  {"name": "n2", "state": "down", "sandboxes": "3"}, {"name": "single"}],
        "sandboxes": [{"id": "a", "node": "n1", "state": "running"}, {"id": "b", "node": "n2", "state": "lost", "memoryBytes": "-1"}],
    })
    n1, n2, single = st.nodes
    assert n1.state == "up" and n1.heartbeat_at is not None and n1.heartbeat_at.second == 58 and n1.url.endswith(":7480")
    assert n2.state == "down" and n2.sandboxes == 3 and n2.heartbeat_at is None
    assert single.state == "up"  # a server older than the field
    assert [(s.sandbox_id, s.node, s.state, s.memory_bytes) for s in st.sandboxes] == [("a", "n1", "running", 0), ("b", "n2", "lost", -1)]


def test_tls_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """SHOAL_CA / SHOAL_CERT / SHOAL_CERT_KEY make the TLS context (the
    handshake itself: test/e2e's TestServeTLS); a certificate without its
    key is refused, and so is a CA file that is not one."""
    from shoal._config import ConnectionConfig

    for k in ("SHOAL_CA", "SHOAL_CERT", "SHOAL_CERT_KEY"):
        monkeypatch.delenv(k, raising=False)
    plain = ConnectionConfig.resolve(url="https://h:1", api_key="k")
    assert plain.ssl_context() is True and plain.ca is None
    monkeypatch.setenv("SHOAL_CERT", str(tmp_path / "c.pem"))
    with pytest.raises(shoal.InvalidArgument, match="SHOAL_CERT_KEY"):
        ConnectionConfig.resolve(url="https://h:1", api_key="k")
    monkeypatch.delenv("SHOAL_CERT")
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate\n")
    monkeypatch.setenv("SHOAL_CA", str(bad))
    c = ConnectionConfig.resolve(url="https://h:1", api_key="k")
    assert c.ca == str(bad) and c.key != plain.key  # its own connection pool
    with pytest.raises(Exception):
        c.ssl_context()


def test_pause_info_eviction() -> None:
    # A pause that memory pressure evicted later (a VM paused in place,
    # snapshotted to a file), and one it did not.
    from shoal.models import PauseInfo

    p = PauseInfo.from_json({"pausedAt": "2026-12-02T10:00:00Z", "method": "in place: process_madvise",
                             "memoryBeforeBytes": "261853184", "memoryAfterBytes": "3502080",
                             "evicted": True, "evictSeconds": 1.07, "evictedToBytes": "78330223"})
    assert p.evicted and p.evict_seconds == 1.07 and p.evicted_to == 78330223
    assert p.memory_after == 3502080
    q = PauseInfo.from_json({"method": "snapshot"})
    assert not q.evicted and q.evict_seconds == 0 and q.evicted_to == 0
    assert not p.file_pages_only and not q.file_pages_only
    assert PauseInfo.from_json({"method": "process_madvise", "filePagesOnly": True}).file_pages_only
