"""PTYs (E2B's sb.pty). Skips while the server answers `unimplemented`."""

from __future__ import annotations

import time
from typing import List

import pytest

import shoal
from shoal import PtySize

from .conftest import skip_unless_implemented


@pytest.fixture
def psb(sb):
    def probe() -> None:
        try:
            sb.pty.resize("nosuchcommand", PtySize(10, 10))
        except shoal.NotFound:
            pass

    skip_unless_implemented("PTYs (ResizePty)", probe)
    return sb


def wait_for(buf: List[bytes], text: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = b"".join(buf).decode(errors="replace")
        if text in out:
            return out
        time.sleep(0.02)
    raise AssertionError(f"{text!r} not in terminal output: {b''.join(buf)!r}")


def test_interactive_shell(psb) -> None:
    data: List[bytes] = []
    term = psb.pty.create(PtySize(rows=24, cols=80), on_data=data.append, cwd="/work")
    assert term.id and term.pid > 0
    psb.pty.send_stdin(term.id, "tty; echo TERM=$TERM; stty size; pwd\n")
    out = wait_for(data, "/work\r\n")
    assert "/dev/pts/" in out and "TERM=xterm-256color" in out and "24 80" in out
    term.resize(PtySize(rows=30, cols=100))
    term.send_stdin("stty size\n")
    wait_for(data, "30 100")
    term.send_stdin("exit 5\n")
    r = term.wait()
    assert r.exit_code == 5  # pty handles do not raise (check=False)
    assert "30 100" in r.stdout  # terminal output is also collected as text


def test_pty_kill_and_iteration(psb) -> None:
    term = psb.pty.create(cmd="echo ready; sleep 60")
    chunks = []
    for _, _, pty in term:
        chunks.append(pty)
        if b"ready" in b"".join(chunks):
            break
    assert psb.pty.kill(term.id) is True
    assert term.wait().signal == "SIGKILL"
