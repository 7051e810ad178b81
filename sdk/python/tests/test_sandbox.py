"""Sandbox lifecycle against a real server, on every backend it offers."""

from __future__ import annotations

import asyncio
import time

import pytest

import shoal
from shoal import Sandbox

from .conftest import CLUSTER, _create_timeout, _probe_backend


def test_create_with_resources_metadata_and_envs(server, backend) -> None:
    with Sandbox.create(
        base=server.base,
        backend=backend,
        cpus=0.5,
        memory="256M",
        timeout=120,
        metadata={"rollout": "17", "job": "sdk-test"},
        envs={"GREETING": "hello"},
    ) as sb:
        info = sb.info
        assert sb.sandbox_id and sb.id == sb.sandbox_id == info.sandbox_id
        assert info.state == "running" and info.backend == backend
        assert info.cpus == 0.5 and info.memory_bytes == 256 << 20 and info.memory_mb == 256
        assert info.timeout == 120
        assert info.metadata == {"rollout": "17", "job": "sdk-test"}
        assert info.layers and info.layers[-1].kind == "base" and info.layers[-1].digest.startswith("sha256:")
        assert info.created_at is not None and info.expires_at is not None and info.end_at > info.started_at
        assert sb.commands.run("echo $GREETING").stdout == "hello\n"
        assert sb.is_running()
    assert not sb.is_running()  # the context manager killed it


def test_connect_list_kill(server, sb) -> None:
    again = Sandbox.connect(sb.sandbox_id)
    assert again.sandbox_id == sb.sandbox_id and again.info.state == "running"
    again.files.write("/work/shared.txt", "from the second handle")
    assert sb.files.read("/work/shared.txt") == "from the second handle"
    assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list()]
    assert [s.sandbox_id for s in Sandbox.list(state=["running"]) if s.sandbox_id == sb.sandbox_id]
    assert sb.kill() is True
    assert sb.kill() is False  # already gone: E2B returns False
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list()]
    with pytest.raises(shoal.SandboxNotFound):
        Sandbox.connect(sb.sandbox_id)


def test_list_filters_by_metadata(server) -> None:
    tag = f"t{time.monotonic_ns()}"
    a = Sandbox.create(base=server.base, metadata={"tag": tag, "i": "0"})
    b = Sandbox.create(base=server.base, metadata={"tag": tag, "i": "1"})
    try:
        assert sorted(s.sandbox_id for s in Sandbox.list(metadata={"tag": tag})) == sorted([a.sandbox_id, b.sandbox_id])
        assert [s.sandbox_id for s in Sandbox.list(metadata={"tag": tag, "i": "1"})] == [b.sandbox_id]
    finally:
        a.kill()
        b.kill()


def test_kill_and_get_info_by_id_on_the_class(server) -> None:
    sb = Sandbox.create(base=server.base)
    assert Sandbox.get_info(sb.sandbox_id).sandbox_id == sb.sandbox_id
    assert Sandbox.kill(sb.sandbox_id) is True
    assert Sandbox.kill(sb.sandbox_id) is False


def test_set_timeout(server, sb) -> None:
    before = sb.get_info()
    info = sb.set_timeout(45)
    assert info.timeout == 45 and sb.info.timeout == 45
    assert info.expires_at is not None and before.expires_at is not None and info.expires_at < before.expires_at
    assert Sandbox.set_timeout(sb.sandbox_id, 90).timeout == 90
    with pytest.raises(shoal.InvalidArgument):
        sb.set_timeout(0)


def test_idle_timeout_deletes_the_sandbox(server) -> None:
    sb = Sandbox.create(base=server.base, timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sb.sandbox_id in [s.sandbox_id for s in Sandbox.list()]:
        time.sleep(0.5)
    with pytest.raises(shoal.SandboxNotFound):
        sb.get_info()


def _host_has_no_swap() -> bool:
    with open("/proc/meminfo") as f:
        return any(line.split()[:2] == ["SwapTotal:", "0"] for line in f)


def test_pause_resume(sb) -> None:
    """A paused sandbox is paused (not running), keeps its files and its
    processes, and resumes by resume() or by the next call (a VM: from its
    snapshot, in a new QEMU)."""
    sb.files.write("/work/keep.txt", "kept")
    h = sb.commands.run("i=0; while :; do i=$((i+1)); echo $i > /work/n; sleep 0.05; done", background=True)
    # The loop runs before the pause (its commands start below the agent,
    # which a VM's one vCPU runs first: its first write can come late).
    sb.commands.run("while [ ! -s /work/n ]; do sleep 0.01; done", timeout=60)
    info = sb.pause()
    assert info.state == "paused"
    assert info.pause is not None and info.pause.memory_before > 0 and info.pause.resumed_at is None
    if info.pause.method != "snapshot":  # reclaimed into swap: the record says when there was none
        assert info.pause.file_pages_only == _host_has_no_swap(), info.pause
    assert not sb.is_running()
    assert sb.pause().state == "paused"  # a second pause changes nothing
    info = sb.resume()
    assert info.state == "running" and info.pause.resumed_at is not None
    assert sb.files.read("/work/keep.txt") == "kept"
    # The loop that ran before the pause runs on after it.
    sb.pause()
    before = sb.get_info()
    assert before.state == "paused"
    n1 = int(sb.files.read("/work/n") or 0)  # transparent resume
    assert sb.get_info().state == "running"
    deadline = time.monotonic() + 20
    while int(sb.files.read("/work/n") or 0) <= n1:
        assert time.monotonic() < deadline, "the loop started before the pause does not run after it"
        time.sleep(0.05)
    h.kill()


def test_async_pause_resume(server) -> None:
    async def main() -> None:
        sb = await shoal.AsyncSandbox.create(base=server.base, timeout=600, auto_pause=0)
        try:
            assert (await sb.get_info()).auto_pause == 0
            await sb.files.write("/work/a.txt", "a")
            assert (await sb.pause()).state == "paused"
            assert not await sb.is_running()
            assert (await sb.resume()).state == "running"
            assert await sb.files.read("/work/a.txt") == "a"
        finally:
            await sb.kill()

    asyncio.run(main())


def test_auto_pause(server, backend) -> None:
    """auto_pause=1: idle for a second, the sandbox is paused; a call resumes it."""
    sb = Sandbox.create(base=server.base, backend=backend, timeout=600, auto_pause=1, request_timeout=_create_timeout(backend))
    try:
        assert sb.get_info().auto_pause == 1
        deadline = time.monotonic() + 30
        while sb.get_info().state != "paused":
            assert time.monotonic() < deadline, "not auto-paused after 30 s idle"
            time.sleep(0.2)
        assert sb.get_info().pause.auto
        assert sb.commands.run("echo hi").stdout == "hi\n"
        assert sb.get_info().state == "running"
    finally:
        sb.kill()


def test_unknown_backend_is_refused_with_the_servers_reason(server) -> None:
    with pytest.raises(shoal.InvalidArgument, match="backend"):
        Sandbox.create(base=server.base, backend="teleport")


def test_bad_arguments(server) -> None:
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, memory="lots")
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, cpus=-1)
    with pytest.raises((shoal.NotFound, shoal.InvalidArgument)) as e:
        Sandbox.create(base="no-such-layer:1")
    assert "no-such-layer" in str(e.value)


def test_ports_helpers(server, sb) -> None:
    host = sb.get_host(8080)
    assert host == f"{server.url.split('://')[1]}/v1/sandboxes/{sb.sandbox_id}/ports/8080"
    assert sb.get_url(8080, "/a/b") == f"http://{host}/a/b"
    with sb.http_client(8080) as c:
        assert str(c.base_url) == f"http://{host}/"
        # The key as X-API-Key: an Authorization header is the app's.
        assert c.headers["x-api-key"] == server.api_key and "authorization" not in c.headers
    with pytest.raises(shoal.InvalidArgument):
        sb.get_host(0)


def test_network_egress_microvm(server) -> None:
    # A microVM asks for egress the same way: a virtio-net eth0 on a tap
    # under the node's rules (what it reaches: TestMicroVMEgress).
    if CLUSTER:
        pytest.skip("the cluster run is of containers")
    reason = _probe_backend(server, "microvm")
    if reason:
        pytest.skip(f"backend microvm: {reason}")
    with Sandbox.create(base=server.base, backend="microvm", allow_out=["203.0.113.9:443"],
                        request_timeout=_create_timeout("microvm")) as sb:
        assert "inet 10." in sb.commands.run("ip -o -4 addr show eth0").stdout
        assert "default via 10." in sb.commands.run("ip route").stdout


def test_network_egress_opt_in(server) -> None:
    # No network by default: loopback only.
    with Sandbox.create(base=server.base) as sb:
        assert sb.commands.run("ip -o link show | grep -v ': lo:' || true").stdout.strip() == ""
    with Sandbox.create(base=server.base, allow_out=["203.0.113.9:443"]) as sb:
        assert "inet 10." in sb.commands.run("ip -o -4 addr show eth0").stdout
    with pytest.raises(shoal.InvalidArgument, match="host names are not supported"):
        Sandbox.create(base=server.base, allow_out=["example.com"])


def test_best_effort_qos(server) -> None:
    # A best-effort sandbox's processes run under SCHED_IDLE (policy 5 in
    # field 41 of /proc/PID/stat), inherited by everything they start; a
    # latency-sensitive one's under SCHED_OTHER (0).
    with Sandbox.create(base=server.base, qos="be") as be, Sandbox.create(base=server.base) as ls:
        assert be.info.qos == "be" and ls.info.qos == "ls"
        assert be.commands.run("cut -d' ' -f41 /proc/self/stat").stdout.strip() == "5"
        assert be.commands.run("sh -c 'sleep 0 & cut -d\" \" -f41 /proc/self/stat'").stdout.strip() == "5"
        assert ls.commands.run("cut -d' ' -f41 /proc/self/stat").stdout.strip() == "0"
        # Commands start at nice 0 (field 19). So that a command that keeps
        # a thousand tasks runnable cannot starve the agent's kill of it,
        # the agent runs above them: on a cgroup v1 host its commands are
        # born in a CPU group of their own under the sandbox's ("cmds")
        # and its threads stay at nice 0; elsewhere its threads run at
        # nice -20 (all but the one thread that forks the commands).
        cmds = "grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup | cut -d: -f3"
        for sb in (be, ls):
            assert sb.commands.run("cut -d' ' -f19 /proc/self/stat").stdout.strip() == "0"
            agent = [t for t in sb.commands.run("cat /proc/1/task/*/stat | sed 's/.*) //' | cut -d' ' -f17,39").stdout.split("\n") if t]
            if sb.commands.run(cmds).stdout.strip().endswith("/cmds"):
                assert agent.count("0 0") >= len(agent) - 1, agent
            else:
                assert agent.count("-20 0") >= len(agent) - 1, agent
        # And the best-effort sandbox's CPU is idle as a group against
        # everything else: on a cgroup v1 host its tasks are in a cpu group
        # under the idle parent beside the sandboxes' (outside the
        # sandbox's cgroup namespace: "/../../<parent>-be/ID/cmds"), a
        # latency-sensitive sandbox's under its namespace's root; on v2 its
        # own group is idle (cpu.idle).
        v1 = "test -e /sys/fs/cgroup/cpu/cpu.shares && grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup | cut -d: -f3"
        be_cpu, ls_cpu = be.commands.run(v1).stdout.strip(), ls.commands.run(v1).stdout.strip()
        if ls_cpu:
            assert ls_cpu == "/cmds"
            assert be_cpu.startswith("/../../") and "-be/" in be_cpu and be_cpu.endswith("/cmds"), be_cpu
        else:
            idle = "cat /sys/fs/cgroup/cpu.idle 2>/dev/null || echo none"
            if ls.commands.run(idle).stdout.strip() != "none":
                assert be.commands.run(idle).stdout.strip() == "1"
                assert ls.commands.run(idle).stdout.strip() == "0"
    with pytest.raises(shoal.InvalidArgument):
        Sandbox.create(base=server.base, qos="fast")


def test_reset(container_sb) -> None:
    """reset() brings the sandbox back to its start in place: its files and
    processes are gone, a background command's wait raises CommandReset,
    and it is the same sandbox, running, with a working agent."""
    sb = container_sb
    sb.files.write("/work/old.txt", "old")
    h = sb.commands.run("sleep 1000", background=True)
    info = sb.reset()
    assert info.sandbox_id == sb.sandbox_id and info.state == "running"
    with pytest.raises(shoal.CommandReset) as e:
        h.wait()
    assert e.value.code == "failed_precondition"
    assert not sb.files.exists("/work/old.txt")
    r = sb.commands.run("ps -o args | grep -c '[s]leep 1000' || true")
    assert r.stdout.strip() == "0", r.stdout
    sb.files.write("/work/new.txt", "new")
    assert sb.files.read("/work/new.txt") == "new"


def test_pause_without_memory(container_sb) -> None:
    """pause(keep_memory=False) ends the sandbox's processes and keeps its
    files: after the resume the files are there, the processes are not."""
    sb = container_sb
    sb.files.write("/work/keep.txt", "kept")
    sb.commands.run("sleep 1000", background=True)
    info = sb.pause(keep_memory=False)
    assert info.state == "paused" and info.pause is not None and info.pause.fs_only
    assert sb.resume().state == "running"
    assert sb.files.read("/work/keep.txt") == "kept"
    r = sb.commands.run("ps -o args | grep -c '[s]leep 1000' || true")
    assert r.stdout.strip() == "0", r.stdout
