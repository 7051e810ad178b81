"""The blocking client is generated from the asyncio one: what is committed
in shoal/_sync is what scripts/unasync.py makes of shoal/_async (no server)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

SDK = Path(__file__).resolve().parent.parent
SCRIPT = SDK / "scripts" / "unasync.py"


def _unasync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sync_is_generated_from_async(tmp_path: Path) -> None:
    out = tmp_path / "_sync"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True)
    made = sorted(os.listdir(out))
    assert made == sorted(n for n in os.listdir(SDK / "shoal" / "_async") if n.endswith(".py"))
    committed = sorted(n for n in os.listdir(SDK / "shoal" / "_sync") if n.endswith(".py"))
    assert committed == made, "shoal/_sync has files that shoal/_async has not (or lacks some)"
    diffs = _unasync().check(str(SDK / "shoal" / "_sync"))
    assert not diffs, "shoal/_sync differs from what scripts/unasync.py generates; run python3 sdk/python/scripts/unasync.py\n" + "".join(diffs)
    for name in made:
        assert (out / name).read_text() == (SDK / "shoal" / "_sync" / name).read_text()


def test_check_reports_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "_sync"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], check=True)
    ok = subprocess.run([sys.executable, str(SCRIPT), "--check", "--out", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    path = out / "commands.py"
    path.write_text(path.read_text().replace("def kill(", "def kill_by_hand(", 1))
    stale = subprocess.run([sys.executable, str(SCRIPT), "--check", "--out", str(out)], capture_output=True, text=True)
    assert stale.returncode == 1
    assert "-    def kill_by_hand(" in stale.stdout and "+    def kill(" in stale.stdout


def test_rules() -> None:
    u = _unasync().unasync
    assert u("async def f(x: AsyncIterator[int]) -> AsyncSandbox:\n    async with a:\n        async for y in await g():\n            await h(y)\n") == (
        "def f(x: Iterator[int]) -> Sandbox:\n    with a:\n        for y in g():\n            h(y)\n"
    )
    assert u("return (await self._call(a, b)).get('x')") == "return self._call(a, b).get('x')"
    assert u("f(await g(x)).y") == "f(g(x)).y"  # a call's own parentheses stay
    assert u("await async_sleep(1); q = AsyncQueue(); _AsyncReader(); raise StopAsyncIteration") == "sleep(1); q = Queue(); _Reader(); raise StopIteration"
    assert u("await r.aread(); await r.aclose(); r.aiter_bytes(); __aenter__ __aexit__ __aiter__ __anext__") == "r.read(); r.close(); r.iter_bytes(); __enter__ __exit__ __iter__ __next__"
    assert u("from .._async.x import y  # (asyncio API)") == "from .._sync.x import y  # (blocking API)"
