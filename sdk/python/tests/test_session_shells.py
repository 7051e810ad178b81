"""Persistent shell sessions. Skips while the server answers `unimplemented`."""

from __future__ import annotations

import asyncio

import pytest

import shoal

from .conftest import skip_unless_implemented


@pytest.fixture
def ssb(sb):
    skip_unless_implemented("shell sessions (ListShells)", sb.shells.list)
    return sb


def test_state_carries_over(ssb) -> None:
    sh = ssb.shells.create("agent", cwd="/work", envs={"START": "s"})
    sh.run("mkdir -p /work/repo && cd /work/repo && export X=42 && Y=local")
    r = sh.run("pwd; echo $X $Y $START")
    assert r.output.replace("\r\n", "\n") == "/work/repo\n42 local s\n" and r.exit_code == 0
    assert "agent" in [s.name for s in ssb.shells.list()]
    assert ssb.shells.run("agent", "echo $X").output.strip() == "42"


def test_exit_codes(ssb) -> None:
    with ssb.shells.create("codes") as sh:
        assert sh.run("false", check=False).exit_code == 1
        with pytest.raises(shoal.CommandExitException) as e:
            sh.run("echo oops; exit_code() { return 3; }; exit_code", check=True)
        assert e.value.exit_code == 3 and "oops" in e.value.stdout
        assert sh.run("echo still here").output.strip() == "still here"
    assert "codes" not in [s.name for s in ssb.shells.list()]  # the with block deleted it


def test_timeout_interrupts_the_command_not_the_shell(ssb) -> None:
    sh = ssb.shells.create("slow")
    sh.run("export KEEP=yes")
    r = sh.run("sleep 30", timeout=0.5, check=False)
    assert r.timed_out
    assert sh.run("echo $KEEP").output.strip() == "yes"
    assert sh.delete() is True
    assert sh.delete() is False


def test_a_command_reading_stdin_ends(ssb) -> None:
    # A run's stdin is /dev/null: a command that reads it gets an end of
    # file at once (it used to read the run's end marker and wait for the
    # run's timeout); the shell's state still carries over (a group, not
    # a subshell).
    with ssb.shells.create("stdin") as sh:
        r = sh.run('read x; echo "rc=$? got=[$x]"; cat; V=set', timeout=30, check=False)
        assert not r.timed_out and r.output.replace("\r\n", "\n") == "rc=1 got=[]\n", r
        assert sh.run("echo $V # a comment ends the line").output.strip() == "set"
        with pytest.raises(shoal.InvalidArgument):
            sh.run("  ")


def test_async_shell(server, ssb) -> None:
    async def main() -> None:
        sb = await shoal.AsyncSandbox.connect(ssb.sandbox_id)
        async with await sb.shells.create("a") as sh:
            await sh.run("cd /tmp")
            assert (await sh.run("pwd")).output.strip() == "/tmp"
        await shoal.aclose()

    asyncio.run(main())
