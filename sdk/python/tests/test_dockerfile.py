"""Dockerfiles built in sandboxes through the SDK (sync and asyncio): the
build log, the result environment, the step cache, and a clear error."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest

import shoal
from shoal import layers


def _context(tmp_path, base: str, last: str) -> str:
    (tmp_path / "app").mkdir(exist_ok=True)
    (tmp_path / "app" / "hello.txt").write_text("hello\n")
    (tmp_path / "app" / "debug.log").write_text("left out by the server\n")  # this SDK sends it
    (tmp_path / ".dockerignore").write_text("**/*.log\n")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {base}\nENV GREETING=hi\nWORKDIR /srv\nCOPY app/ ./\nRUN echo $GREETING > made.txt\n{last}\nCMD [\"cat\", \"made.txt\"]\n"
    )
    return str(tmp_path)


def test_build_dockerfile(server, tmp_path) -> None:
    ctx = _context(tmp_path, server.base, "RUN echo one > last.txt")
    log: List[Dict[str, Any]] = []
    r = layers.build_dockerfile(ctx, "sdk-df:1", on_log=log.append)
    assert (r.environment.name, r.layer.ref, r.steps_run, r.steps_cached) == ("sdk-df", "sdk-df:1", 4, 0)
    assert r.environment.image is not None and r.environment.image.working_dir == "/srv"
    assert "GREETING=hi" in r.environment.image.env and r.environment.image.cmd == ["cat", "made.txt"]
    assert any(e.get("step") == 1 and e.get("line") == 1 for e in log), log
    with shoal.Sandbox.create(template="sdk-df") as sb:
        out = sb.commands.run("cat hello.txt made.txt last.txt; pwd; test -e debug.log || echo ignored")
        assert out.stdout == "hello\nhi\none\n/srv\nignored\n"

    # The last step changed: only it runs (asyncio this time).
    ctx = _context(tmp_path, server.base, "RUN echo two > last.txt")
    r2 = asyncio.run(layers.abuild_dockerfile(ctx, "sdk-df:2", environment="sdk-df2"))
    assert (r2.environment.name, r2.steps_run, r2.steps_cached) == ("sdk-df2", 1, 3)

    (tmp_path / "Dockerfile").write_text(f"FROM {server.base}\nRUN exit 7\n")
    with pytest.raises(shoal.ShoalError, match="line 2.*exited with code 7"):
        layers.build_dockerfile(ctx, "sdk-df:3")
    (tmp_path / "Dockerfile").write_text(f"FROM {server.base}\nCOPY ../x /x\n")
    with pytest.raises(shoal.InvalidArgument, match="outside the build context"):
        asyncio.run(layers.abuild_dockerfile(ctx, "sdk-df:3"))
