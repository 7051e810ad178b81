"""commands.run and background handles against a real server, on every backend."""

from __future__ import annotations

import hashlib
import io
import threading
import time
import uuid

import pytest

import shoal


def test_exit_codes_stdout_stderr(sb) -> None:
    r = sb.commands.run("echo out; echo err >&2")
    assert (r.exit_code, r.stdout, r.stderr, r.error) == (0, "out\n", "err\n", None)
    assert r.command_id and r.pid > 0
    # E2B's behaviour: a non-zero exit raises, carrying the whole result.
    with pytest.raises(shoal.CommandExitException) as e:
        sb.commands.run("echo partial; echo why >&2; exit 3", check=True)
    assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "partial\n", "why\n")
    assert "code 3" in str(e.value) and "why" in str(e.value)
    # ... unless asked not to.
    r = sb.commands.run("exit 7", check=False)
    assert r.exit_code == 7


def test_argv_list_is_not_a_shell_line(sb) -> None:
    r = sb.commands.run(["echo", "a  b", "$HOME", ";", "c"])
    assert r.stdout == "a  b $HOME ; c\n"


def test_missing_program(sb) -> None:
    with pytest.raises(shoal.CommandNotFound):
        sb.commands.run(["/no/such/program"])
    with pytest.raises(shoal.CommandNotFound):
        sb.commands.run(["no-such-program"], background=True)
    sb.files.make_dir("/tmp/a-dir")
    with pytest.raises(shoal.CommandNotExecutable) as e:
        sb.commands.run(["/tmp/a-dir"])
    assert e.value.code == "permission_denied"
    # A missing working directory is not a missing program.
    with pytest.raises(shoal.NotFound) as e:
        sb.commands.run(["true"], cwd="/no/such/dir")
    assert not isinstance(e.value, shoal.CommandNotFound)


def test_streaming_callbacks_arrive_while_the_command_runs(sb) -> None:
    # The command cannot finish until the callback for its first line has
    # run (it opens the gate): no timing assumption about a loaded host.
    gate = f"/tmp/gate-{uuid.uuid4().hex}"
    seen = []

    def on_stdout(s: str) -> None:
        seen.append(("out", s))
        if s == "first\n":
            sb.files.write(gate, "")

    r = sb.commands.run(
        f"echo first; while [ ! -e {gate} ]; do sleep 0.02; done; echo second; echo oops >&2",
        on_stdout=on_stdout,
        on_stderr=lambda s: seen.append(("err", s)),
        timeout=60,
    )
    # stdout and stderr are separate pipes: their relative order is not defined
    assert [s for k, s in seen if k == "out"] == ["first\n", "second\n"]
    assert [s for k, s in seen if k == "err"] == ["oops\n"]
    assert r.stdout == "first\nsecond\n" and r.stderr == "oops\n"


def test_large_output(sb) -> None:
    r = sb.commands.run("head -c 3000000 /dev/zero | tr '\\0' 'x'; echo")
    assert len(r.stdout) == 3000001 and set(r.stdout[:-1]) == {"x"}


def test_stdin_str_bytes_and_streams(sb) -> None:
    assert sb.commands.run("cat", stdin="hello\n").stdout == "hello\n"
    assert sb.commands.run("wc -c", stdin=b"\x00\x01\x02").stdout.strip() == "3"
    assert sb.commands.run("cat").stdout == ""  # no stdin: end of file at once
    big = bytes(range(256)) * (12 << 10)  # 3 MiB: streamed with SendStdin
    r = sb.commands.run("sha256sum | cut -d' ' -f1", stdin=io.BytesIO(big))
    assert r.stdout.strip() == hashlib.sha256(big).hexdigest()
    r = sb.commands.run("wc -c", stdin=iter([b"ab", b"cd", "ef"]))
    assert r.stdout.strip() == "6"


def test_timeout_kills_the_command(sb) -> None:
    t0 = time.monotonic()
    with pytest.raises(shoal.CommandTimeout) as e:
        sb.commands.run("echo started; sleep 30", timeout=1, check=True)
    assert time.monotonic() - t0 < 10
    assert e.value.result.timed_out and e.value.stdout == "started\n"
    assert isinstance(e.value, shoal.Timeout) and isinstance(e.value, shoal.CommandExitException)
    r = sb.commands.run("sleep 30", timeout=0.5, check=False)
    assert r.timed_out and r.exit_code != 0


def test_cwd_and_envs(sb) -> None:
    sb.files.make_dir("/work/sub")
    assert sb.commands.run("pwd", cwd="/work/sub").stdout == "/work/sub\n"
    r = sb.commands.run("echo $A-$B", envs={"A": "1", "B": "two words"})
    assert r.stdout == "1-two words\n"
    with pytest.raises(shoal.ShoalError):
        sb.commands.run("pwd", cwd="/no/such/dir")


def test_users(sb) -> None:
    assert sb.commands.run("id -u; pwd").stdout == "0\n/\n"  # root by default
    assert sb.commands.run("id -u", user="root").stdout == "0\n"
    r = sb.commands.run('echo "$(id -u) $(id -g) $(id -G) $(pwd) $HOME $USER"', user="user")
    assert r.stdout == "1000 1000 1000 100 /home/user /home/user user\n"
    h = sb.commands.run("whoami", user="user", background=True)
    assert h.wait().stdout == "user\n"
    with pytest.raises(shoal.InvalidArgument, match="no such user"):
        sb.commands.run("id", user="nosuchuser")
    # Files: written as the user, they are the user's; its permissions hold.
    w = sb.files.write("/home/user/sub/a.txt", "hi", user="user")
    assert w.path == "/home/user/sub/a.txt"
    assert sb.commands.run("stat -c %U:%G /home/user/sub/a.txt /home/user/sub").stdout == "user:user\nuser:user\n"
    info = sb.files.get_info("/home/user/sub/a.txt")
    assert (info.owner, info.group) == ("user", "user")
    assert {e.name: e.owner for e in sb.files.list("/home/user/sub", user="user")} == {"a.txt": "user"}
    assert sb.files.read("/home/user/sub/a.txt", user="user") == "hi"
    with pytest.raises(shoal.PermissionDenied):
        sb.files.write("/etc/evil", "x", user="user")
    with pytest.raises(shoal.PermissionDenied):
        sb.files.make_dir("/etc/evil.d", user="user")
    sb.commands.run("echo s > /root/secret; chmod 600 /root/secret")
    with pytest.raises(shoal.PermissionDenied):
        sb.files.read("/root/secret", user="user")
    sh = sb.shells.create("as-user", user="user")
    assert sh.run("id -un; pwd").output == "user\n/home/user\n"
    # A watch is armed with the user's permissions too.
    sb.commands.run("mkdir -m 700 /root/private")
    with pytest.raises(shoal.PermissionDenied):
        sb.files.watch_dir("/root/private", user="user")
    w = sb.files.watch_dir("/home/user", user="user")
    try:
        sb.files.write("/home/user/watched.txt", "x", user="user")
        deadline = time.monotonic() + 15  # a hang detector
        names = []
        while "watched.txt" not in names and time.monotonic() < deadline:
            names += [e.name for e in w.get_new_events()]
            time.sleep(0.05)
        assert "watched.txt" in names
    finally:
        w.stop()


def test_background_wait(sb) -> None:
    h = sb.commands.run("echo a; sleep 0.5; echo b; exit 4", background=True)
    assert isinstance(h, shoal.CommandHandle) and h.id and h.pid > 0
    assert h.exit_code is None
    with pytest.raises(shoal.CommandExitException) as e:
        h.wait(check=True)
    assert e.value.exit_code == 4 and e.value.stdout == "a\nb\n"
    assert h.exit_code == 4 and h.stdout == "a\nb\n"
    assert h.wait(check=False).exit_code == 4  # waiting again returns the same result


def test_background_iteration_and_callbacks(sb) -> None:
    got = []
    h = sb.commands.run("for i in 1 2 3; do echo $i; echo e$i >&2; done", background=True, on_stdout=got.append)
    items = list(h)
    assert "".join(o for o, _, _ in items if o) == "1\n2\n3\n"
    assert "".join(e for _, e, _ in items if e) == "e1\ne2\ne3\n"
    assert "".join(got) == "1\n2\n3\n"
    assert h.wait().exit_code == 0


def test_background_send_stdin(sb) -> None:
    h = sb.commands.run("while read line; do echo got:$line; done", background=True, stdin=True)
    h.send_stdin("one\n")
    h.send_stdin(b"two\n")
    h.close_stdin()
    assert h.wait().stdout == "got:one\ngot:two\n"
    # E2B style: by command ID on sb.commands
    h = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.send_stdin(h.id, "x")
    sb.commands.close_stdin(h.id)
    assert h.wait().stdout == "x"


def test_background_kill(sb) -> None:
    h = sb.commands.run("echo alive; sleep 60", background=True)
    deadline = time.monotonic() + 30
    while "alive" not in h.stdout and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert h.kill() is True
    r = h.wait(check=False)
    assert time.monotonic() - t0 < 10
    assert r.signal == "SIGKILL" and r.exit_code == 137 and r.stdout == "alive\n"
    assert sb.commands.kill(h.id) is False  # exited already (or gone): nothing to kill


def test_wait_timeout_leaves_the_command_running(sb) -> None:
    gate = f"/tmp/gate-{uuid.uuid4().hex}"
    h = sb.commands.run(f"while [ ! -e {gate} ]; do sleep 0.02; done; echo done", background=True)
    with pytest.raises(shoal.Timeout):
        h.wait(timeout=0.1)
    sb.files.write(gate, "")
    assert h.wait(timeout=30).stdout == "done\n"


def test_signal(sb) -> None:
    h = sb.commands.run("trap 'echo term; exit 9' TERM; echo ready; while true; do sleep 0.1; done", background=True)
    deadline = time.monotonic() + 30
    while "ready" not in h.stdout and time.monotonic() < deadline:
        time.sleep(0.05)
    h.signal("SIGTERM")
    r = h.wait(check=False)
    assert r.exit_code == 9 and "term" in r.stdout


def test_concurrent_commands_from_threads(sb) -> None:
    results = {}

    def one(i: int) -> None:
        results[i] = sb.commands.run(f"echo {i}").stdout

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n" for i in range(16)}
