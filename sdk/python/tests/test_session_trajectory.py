"""Trajectories: steps numbered by the SDK, replayed by the server when the
same script runs again. Skips while the server answers `unimplemented`."""

from __future__ import annotations

import asyncio
import uuid
from typing import List

import pytest

import shoal

from .conftest import skip_unless_implemented


@pytest.fixture
def tsb(sb):
    def probe() -> None:
        try:
            sb.trajectory("probe").info()
        except shoal.NotFound:
            pass

    skip_unless_implemented("trajectories (GetTrajectory)", probe)
    return sb


def rollout(sb: shoal.Sandbox, tid: str, steps: int) -> List[shoal.CommandResult]:
    """A small agent loop with side effects that must happen once."""
    cmds = [
        "echo step1 >> /work/log; echo A",
        "cat /proc/sys/kernel/random/uuid",  # a different answer each time it runs
        "echo step3 >> /work/log; wc -l < /work/log",
        "cat /work/log",
    ]
    out = []
    with sb.trajectory(tid) as t:
        for c in cmds[:steps]:
            out.append(t.run(c))
    return out


def test_rerun_fast_forwards(tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"
    first = rollout(tsb, tid, 4)
    assert [r.replayed for r in first] == [False] * 4
    assert [r.step for r in first] == [1, 2, 3, 4]
    again = rollout(tsb, tid, 4)  # the same script, after a "crash"
    assert [r.replayed for r in again] == [True] * 4
    assert [(r.stdout, r.exit_code) for r in again] == [(r.stdout, r.exit_code) for r in first]
    assert tsb.files.read("/work/log") == "step1\nstep3\n"  # side effects happened once


def test_crash_in_the_middle(tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"
    part = rollout(tsb, tid, 2)  # the trainer dies after step 2
    t = tsb.trajectory(tid)
    results = [t.run(c) for c in ("echo step1 >> /work/log; echo A", "cat /proc/sys/kernel/random/uuid", "echo new; echo step3 >> /work/log")]
    assert (t.replayed, t.executed) == (2, 1)
    assert results[1].stdout == part[1].stdout
    assert tsb.files.read("/work/log") == "step1\nstep3\n"
    info = t.info()
    assert info.id == tid and [s.step for s in info.steps] == [1, 2, 3]
    assert all(s.command_id for s in info.steps)
    assert tid in [x.id for x in tsb.list_trajectories()]


def test_divergence_is_refused(tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"
    rollout(tsb, tid, 2)
    t = tsb.trajectory(tid)
    with pytest.raises(shoal.TrajectoryDiverged) as e:
        t.run("echo something else")
    assert "diverged" in str(e.value) and isinstance(e.value, shoal.FailedPrecondition)


def test_failed_step_replays_its_failure(tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"
    for attempt in range(2):
        t = tsb.trajectory(tid)
        with pytest.raises(shoal.CommandExitException) as e:
            t.run("echo bad >&2; exit 4", check=True)
        assert e.value.exit_code == 4 and e.value.stderr == "bad\n"
        assert e.value.result.replayed == (attempt == 1)


def test_start_step_and_stdin(tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"
    t = tsb.trajectory(tid, start_step=10)
    assert t.run("cat", stdin="in").stdout == "in" and t.next_step == 11
    with pytest.raises(shoal.InvalidArgument):
        tsb.trajectory(tid).run("cat", stdin=iter([b"x"]))  # type: ignore[arg-type]


def test_async_trajectory(server, tsb) -> None:
    tid = f"rollout-{uuid.uuid4().hex[:8]}"

    async def script() -> List[shoal.CommandResult]:
        sb = await shoal.AsyncSandbox.connect(tsb.sandbox_id)
        async with sb.trajectory(tid) as t:
            return [await t.run("echo x >> /work/alog; cat /work/alog"), await t.run("cat /proc/sys/kernel/random/uuid")]

    async def main() -> None:
        a = await script()
        b = await script()
        assert [r.replayed for r in a + b] == [False, False, True, True]
        assert [r.stdout for r in a] == [r.stdout for r in b]
        await shoal.aclose()

    asyncio.run(main())
    assert tsb.files.read("/work/alog") == "x\n"
