"""Errors are exceptions named for what happened, carrying the server's message."""

from __future__ import annotations

import time

import pytest

import shoal
from shoal import Sandbox


def test_unknown_sandbox(server) -> None:
    with pytest.raises(shoal.SandboxNotFound) as e:
        Sandbox.connect("doesnotexist000000000")
    assert "doesnotexist000000000" in str(e.value) and e.value.code == "not_found" and e.value.status == 404
    assert Sandbox.kill("doesnotexist000000000") is False
    with pytest.raises(shoal.SandboxNotFound):
        Sandbox.get_info("doesnotexist000000000")


def test_operations_on_a_killed_sandbox(server) -> None:
    sb = Sandbox.create(base=server.base)
    sb.kill()
    for call in (
        lambda: sb.commands.run("true"),
        lambda: sb.files.read("/etc/passwd"),
        lambda: sb.files.write("/work/x", "x"),
        lambda: sb.files.list("/"),
        lambda: sb.files.exists("/etc/passwd"),
        lambda: sb.set_timeout(60),
        lambda: sb.get_info(),
    ):
        with pytest.raises(shoal.SandboxNotFound):
            call()


def test_bad_key(server) -> None:
    with pytest.raises(shoal.AuthError) as e:
        Sandbox.create(base=server.base, api_key="sk_wrong_wrong_wrong")
    assert "invalid API key" in str(e.value) and e.value.status == 401
    with pytest.raises(shoal.AuthError):
        Sandbox.list(api_key="sk_wrong_wrong_wrong")
    # also a handle whose key is wrong, for streams and file bytes
    sb = Sandbox.create(base=server.base)
    try:
        bad = Sandbox(sb.info, shoal._sync.transport.transport_for(api_key="sk_wrong_wrong_wrong"))
        with pytest.raises(shoal.AuthError):
            bad.commands.run("true")
        with pytest.raises(shoal.AuthError):
            bad.files.read("/etc/passwd")
        with pytest.raises(shoal.AuthError):
            bad.files.write("/work/x", "x")
    finally:
        sb.kill()


def test_unreachable_server_is_unavailable(server) -> None:
    t0 = time.monotonic()
    with pytest.raises(shoal.Unavailable) as e:
        Sandbox.list(url="http://127.0.0.1:9")  # discard port: connection refused
    assert "cannot connect" in str(e.value)
    assert time.monotonic() - t0 < 30  # retried with back-off, then gave up


def test_unknown_command(container_sb) -> None:
    assert container_sb.commands.kill("nosuchcommand") is False
    with pytest.raises(shoal.NotFound) as e:
        container_sb.commands.send_stdin("nosuchcommand", "x")
    assert not isinstance(e.value, shoal.SandboxNotFound)


def test_errors_are_catchable_by_e2b_names(server) -> None:
    with pytest.raises(shoal.NotFoundException):
        Sandbox.connect("doesnotexist000000000")
    with pytest.raises(shoal.SandboxException):
        Sandbox.connect("doesnotexist000000000")
    with pytest.raises(shoal.AuthenticationException):
        Sandbox.list(api_key="sk_wrong_wrong_wrong")
