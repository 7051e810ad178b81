"""AsyncSandbox: the same surface with await, many sandboxes at once."""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any, List

import pytest

import shoal
from shoal import AsyncSandbox


def run(coro: Any) -> Any:
    async def main() -> Any:
        try:
            return await coro
        finally:
            await shoal.aclose()

    return asyncio.run(main())


def test_16_sandboxes_concurrently(server) -> None:
    async def rollout(i: int) -> dict:
        async with await AsyncSandbox.create(base=server.base, metadata={"rollout": str(i)}) as sb:
            await sb.files.write("/work/solution.sh", f"echo $(( {i} * {i} ))\n")
            await sb.files.write("/work/test.sh", f'[ "$(sh /work/solution.sh)" = "{i * i}" ] && echo PASS > /work/result || echo FAIL > /work/result\n')
            r = await sb.commands.run("sh /work/test.sh")
            result = await sb.files.read("/work/result")
            out: List[str] = []
            h = await sb.commands.run("cat; echo", background=True, stdin=True, on_stdout=out.append)
            await h.send_stdin(f"rollout-{i}")
            await h.close_stdin()
            res = await h.wait()
            return {"id": sb.sandbox_id, "exit": r.exit_code, "result": result, "bg": res.stdout, "cb": "".join(out)}

    async def main() -> List[dict]:
        return await asyncio.gather(*[rollout(i) for i in range(16)])

    t0 = time.monotonic()
    results = run(main())
    elapsed = time.monotonic() - t0
    assert len({r["id"] for r in results}) == 16
    for i, r in enumerate(results):
        assert (r["exit"], r["result"], r["bg"], r["cb"]) == (0, "PASS\n", f"rollout-{i}\n", f"rollout-{i}\n")
    assert elapsed < 120
    assert not [s for s in shoal.Sandbox.list() if "rollout" in s.metadata]  # all cleaned up


def test_async_commands(server) -> None:
    async def main() -> None:
        sb = await AsyncSandbox.create(base=server.base, envs={"X": "1"})
        try:
            r = await sb.commands.run("echo $X; echo e >&2")
            assert (r.stdout, r.stderr, r.exit_code) == ("1\n", "e\n", 0)
            with pytest.raises(shoal.CommandExitException) as e:
                await sb.commands.run("exit 5", check=True)
            assert e.value.exit_code == 5
            assert (await sb.commands.run("exit 5", check=False)).exit_code == 5
            with pytest.raises(shoal.CommandTimeout):
                await sb.commands.run("sleep 30", timeout=0.5, check=True)
            assert (await sb.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
            assert (await sb.commands.run("cat", stdin="in")).stdout == "in"
            got: List[str] = []

            async def cb(s: str) -> None:  # coroutine callbacks are awaited
                got.append(s)

            await sb.commands.run("echo a; sleep 0.2; echo b", on_stdout=cb)
            assert got == ["a\n", "b\n"]
            h = await sb.commands.run("for i in 1 2 3; do echo $i; done", background=True)
            items = [o async for o, _, _ in h]
            assert "".join(x for x in items if x) == "1\n2\n3\n"
            h = await sb.commands.run("sleep 60", background=True)
            assert await h.kill() is True
            r = await h.wait(check=False)
            assert r.signal == "SIGKILL"
            with pytest.raises(shoal.Timeout):
                await (await sb.commands.run("sleep 2", background=True)).wait(timeout=0.1)
        finally:
            await sb.kill()

    run(main())


def test_async_files(server, tmp_path) -> None:
    data = hashlib.sha256(b"seed").digest() * (1 << 18)  # 8 MiB
    src = tmp_path / "src.bin"
    src.write_bytes(data)

    async def main() -> None:
        async with await AsyncSandbox.create(base=server.base) as sb:
            await sb.files.write("/work/t.txt", "text")
            assert await sb.files.read("/work/t.txt") == "text"
            assert await sb.files.read("/work/t.txt", format="bytes") == b"text"
            assert (await sb.files.upload(src, "/work/big")).bytes == len(data)
            chunks = [c async for c in await sb.files.read("/work/big", format="stream")]
            assert b"".join(chunks) == data
            assert await sb.files.download("/work/big", tmp_path / "dst.bin") == len(data)
            assert (tmp_path / "dst.bin").read_bytes() == data

            async def agen():
                for i in range(4):
                    yield bytes([i]) * 1000

            assert (await sb.files.write("/work/gen", agen())).bytes == 4000
            assert await sb.files.exists("/work/t.txt") and not await sb.files.exists("/work/no")
            assert await sb.files.make_dir("/work/d") is True
            assert {e.name for e in await sb.files.list("/work")} >= {"t.txt", "big", "gen", "d"}
            await sb.files.remove("/work/d")
            with pytest.raises(shoal.InvalidArgument):
                await sb.files.read("/work/../etc/passwd")

    run(main())


def test_async_lifecycle_and_errors(server) -> None:
    async def main() -> None:
        sb = await AsyncSandbox.create(base=server.base, timeout=100)
        again = await AsyncSandbox.connect(sb.sandbox_id)
        assert again.sandbox_id == sb.sandbox_id
        assert sb.sandbox_id in [s.sandbox_id for s in await AsyncSandbox.list()]
        assert (await sb.set_timeout(50)).timeout == 50
        assert (await AsyncSandbox.get_info(sb.sandbox_id)).timeout == 50
        assert await sb.is_running()
        assert await sb.kill() is True
        assert await AsyncSandbox.kill(sb.sandbox_id) is False
        assert not await sb.is_running()
        with pytest.raises(shoal.SandboxNotFound):
            await AsyncSandbox.connect(sb.sandbox_id)
        with pytest.raises(shoal.AuthError):
            await AsyncSandbox.list(api_key="sk_wrong_wrong_wrong")

    run(main())


def test_async_reset(server) -> None:
    async def main() -> None:
        sb = await AsyncSandbox.create(base=server.base, timeout=100)
        try:
            await sb.files.write("/work/old.txt", "old")
            h = await sb.commands.run("sleep 1000", background=True)
            info = await sb.reset()
            assert info.sandbox_id == sb.sandbox_id and info.state == "running"
            with pytest.raises(shoal.CommandReset):
                await h.wait()
            assert not await sb.files.exists("/work/old.txt")
            assert (await sb.commands.run("echo ok")).stdout.strip() == "ok"
            # A pause without memory keeps the files, not the processes.
            await sb.commands.run("sleep 1000", background=True)
            info = await sb.pause(keep_memory=False)
            assert info.state == "paused" and info.pause.fs_only
            await sb.resume()
            r = await sb.commands.run("ps -o args | grep -c '[s]leep 1000' || true")
            assert r.stdout.strip() == "0"
        finally:
            await sb.kill()

    run(main())


def test_each_event_loop_gets_its_own_pool(server) -> None:
    # asyncio.run() twice (as notebooks and scripts do) must not reuse a closed loop's client.
    for _ in range(2):
        assert isinstance(asyncio.run(AsyncSandbox.list()), list)
