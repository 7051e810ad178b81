"""Durable commands (session layer): list/get/wait, re-attach by log offset,
transparent resume after a lost connection. Skips while the server answers
`unimplemented` (SHOAL_SDK_STRICT=1 makes that a failure)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

import shoal
from shoal import Sandbox

from .conftest import skip_unless_implemented


@pytest.fixture
def csb(sb):
    skip_unless_implemented("ListCommands", sb.commands.list)
    return sb


def test_list_and_get(csb) -> None:
    r = csb.commands.run("echo listed; exit 3", check=False)
    cmds = {c.id: c for c in csb.commands.list()}
    assert r.command_id in cmds
    c = cmds[r.command_id]
    assert (c.state, c.exit_code, c.args) == ("exited", 3, ["sh", "-c", "echo listed; exit 3"])
    assert c.pid == r.pid and c.log_bytes > 0 and c.started_at and c.ended_at
    assert csb.commands.get(r.command_id).exit_code == 3
    with pytest.raises(shoal.NotFound):
        csb.commands.get("nosuchcommand")


def test_wait_on_the_server(csb) -> None:
    gate = f"/tmp/gate-{uuid.uuid4().hex}"
    h = csb.commands.run(f"while [ ! -e {gate} ]; do sleep 0.02; done; echo done", background=True)
    info = csb.commands.wait(h.id, timeout=0.1)
    assert info.state == "running" and info.exit_code is None
    csb.files.write(gate, "")
    info = csb.commands.wait(h.id)
    assert info.state == "exited" and info.exit_code == 0


def test_reattach_by_offset_gets_every_byte_once(csb) -> None:
    h = csb.commands.run("for i in $(seq 1 30); do echo line$i; sleep 0.03; done", background=True)
    while "line3\n" not in h.stdout:
        time.sleep(0.01)
    h.disconnect()
    seen, offset = h.stdout, h.offset
    assert offset > 0
    csb.commands.wait(h.id)  # the command ran on without us
    again = csb.commands.connect(h.id, offset=offset)
    rest = again.wait().stdout
    assert seen + rest == "".join(f"line{i}\n" for i in range(1, 31))
    # from 0: everything, from another client object (as after a trainer restart)
    other = Sandbox.connect(csb.sandbox_id)
    assert other.commands.connect(h.id).wait().stdout == seen + rest


def test_lost_connection_is_resumed_transparently(csb) -> None:
    h = csb.commands.run("for i in $(seq 1 40); do echo n$i; echo e$i >&2; sleep 0.02; done", background=True)
    while "n5\n" not in h.stdout:
        time.sleep(0.01)
    h._reader.abort.cut()  # what a network failure does to the stream
    r = h.wait()
    assert r.stdout == "".join(f"n{i}\n" for i in range(1, 41))
    assert r.stderr == "".join(f"e{i}\n" for i in range(1, 41))


def test_background_command_survives_disconnect(csb) -> None:
    h = csb.commands.run("sleep 0.5; echo survived > /work/flag", background=True)
    h.disconnect()
    assert csb.commands.wait(h.id, timeout=20).exit_code == 0
    assert csb.files.read("/work/flag") == "survived\n"


def test_kill_by_pid_e2b_style(csb) -> None:
    h = csb.commands.run("sleep 60", background=True)
    assert csb.commands.kill(h.pid) is True  # an int is a pid, looked up in list()
    assert h.wait(check=False).signal == "SIGKILL"


def test_async_reattach(server, csb) -> None:
    async def main() -> None:
        sb = await shoal.AsyncSandbox.connect(csb.sandbox_id)
        h = await sb.commands.run("for i in 1 2 3 4 5; do echo $i; sleep 0.05; done", background=True)
        first = None
        async for out, _, _ in h:
            first = out
            break
        await h.disconnect()
        info = await sb.commands.wait(h.id)
        assert info.exit_code == 0
        h2 = await sb.commands.connect(h.id, offset=h.offset)
        r = await h2.wait()
        assert h.stdout + r.stdout == "1\n2\n3\n4\n5\n" and first == "1\n"
        assert h.id in [c.id for c in await sb.commands.list()]
        await shoal.aclose()

    asyncio.run(main())


def test_killed_sandbox_is_not_an_exit(container_sb) -> None:
    """A command whose sandbox is deleted under it raises SandboxKilled,
    naming the sandbox, from every way of waiting for it; it never looks
    like an exit."""
    sb = container_sb
    skip_unless_implemented("ListCommands", sb.commands.list)
    h = sb.commands.run("echo started; sleep 600", background=True)
    fg_result: list = []

    def foreground() -> None:
        try:
            fg_result.append(sb.commands.run("echo fg; sleep 600"))
        except BaseException as e:  # noqa: BLE001 (checked below)
            fg_result.append(e)

    def server_wait() -> None:
        try:
            fg_result.append(sb.commands.wait(h.id))
        except BaseException as e:  # noqa: BLE001
            fg_result.append(e)

    threads = [threading.Thread(target=foreground), threading.Thread(target=server_wait)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while "started" not in h.stdout or sum(1 for c in sb.commands.list() if c.state == "running") < 2:
        assert time.monotonic() < deadline, "the commands did not start"
        time.sleep(0.01)
    assert sb.kill() is True
    with pytest.raises(shoal.SandboxKilled) as ei:
        h.wait(timeout=30)
    e = ei.value
    assert isinstance(e, shoal.SandboxNotFound) and e.sandbox_id == sb.sandbox_id and sb.sandbox_id in str(e)
    assert h.exit_code is None and h.stdout == "started\n"
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    assert len(fg_result) == 2
    for r in fg_result:
        assert isinstance(r, shoal.SandboxKilled), f"{type(r).__name__}: {r}"
