"""Directory watches and recursive listing. Skips while the server answers
`unimplemented` for WatchDir (recursive ListDir landed with it)."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

import shoal
from shoal import FilesystemEventType as Op

from .conftest import skip_unless_implemented


@pytest.fixture
def wsb(sb):
    sb.files.make_dir("/work/w")
    skip_unless_implemented("WatchDir", lambda: sb.files.watch_dir("/work/w").stop())
    return sb


def test_recursive_list(wsb) -> None:
    wsb.files.write("/work/w/a/b/c.txt", "c")
    wsb.files.write("/work/w/top.txt", "t")
    one = {e.path for e in wsb.files.list("/work/w")}
    assert one == {"/work/w/a", "/work/w/top.txt"}
    three = {e.path for e in wsb.files.list("/work/w", depth=3)}
    assert three == {"/work/w/a", "/work/w/a/b", "/work/w/a/b/c.txt", "/work/w/top.txt"}
    with pytest.raises(shoal.InvalidArgument):
        wsb.files.list("/work/w", depth=0)


def test_watch_dir(wsb) -> None:
    seen: List[shoal.FilesystemEvent] = []
    with wsb.files.watch_dir("/work/w", on_event=seen.append) as w:
        wsb.files.write("/work/w/new.txt", "x")  # the watch is armed when watch_dir returns
        ev = w.wait_for(lambda e: e.name == "new.txt" and e.type in (Op.CREATE, Op.WRITE, Op.RENAME))
        assert ev.path == "/work/w/new.txt"
        wsb.files.remove("/work/w/new.txt")
        w.wait_for(lambda e: e.name == "new.txt" and e.type == Op.REMOVE)
        wsb.commands.run("echo x > /work/w/m1 && mv /work/w/m1 /work/w/m2")
        ev = w.wait_for(lambda e: e.type == Op.RENAME and e.name == "m2")
        assert ev.old_path == "/work/w/m1"
    assert any(e.name == "new.txt" for e in seen)


def test_watch_recursive_and_polling(wsb) -> None:
    wsb.files.make_dir("/work/w/sub")
    w = wsb.files.watch_dir("/work/w", recursive=True)
    try:
        wsb.files.write("/work/w/sub/deep.txt", "d")
        w.wait_for(lambda e: e.name == "sub/deep.txt")
        wsb.files.write("/work/w/sub/more.txt", "m")
        import time

        deadline = time.monotonic() + 10
        names: List[str] = []
        while "sub/more.txt" not in names and time.monotonic() < deadline:
            names += [e.name for e in w.get_new_events()]  # E2B's polling interface
            time.sleep(0.05)
        assert "sub/more.txt" in names
    finally:
        w.stop()


def test_watch_missing_dir(wsb) -> None:
    with pytest.raises(shoal.NotFound):
        wsb.files.watch_dir("/work/nope")


def test_async_watch(server, wsb) -> None:
    async def main() -> None:
        sb = await shoal.AsyncSandbox.connect(wsb.sandbox_id)
        got: List[shoal.FilesystemEvent] = []

        async def on_event(e: shoal.FilesystemEvent) -> None:
            got.append(e)

        w = await sb.files.watch_dir("/work/w", on_event=on_event)
        await sb.files.write("/work/w/async.txt", "a")
        ev = await w.wait_for(lambda e: e.name == "async.txt")
        assert ev.path == "/work/w/async.txt"
        await w.stop()
        assert any(e.name == "async.txt" for e in got)
        entries = await sb.files.list("/work", depth=2)
        assert "/work/w/async.txt" in [e.path for e in entries]
        await shoal.aclose()

    asyncio.run(main())
