"""sb.files against a real server, on every backend."""

from __future__ import annotations

import hashlib

import pytest

import shoal


def test_text_and_bytes(sb) -> None:
    info = sb.files.write("/work/hello.txt", "héllo\n")
    assert (info.name, info.path, info.type, info.bytes) == ("hello.txt", "/work/hello.txt", shoal.FileType.FILE, 7)
    assert sb.files.read("/work/hello.txt") == "héllo\n"
    assert sb.files.read("/work/hello.txt", format="bytes") == "héllo\n".encode()
    blob = bytes(range(256)) * 4
    sb.files.write("/work/blob.bin", blob)
    assert sb.files.read("/work/blob.bin", format="bytes") == blob
    assert sb.commands.run("wc -c < /work/blob.bin").stdout.strip() == "1024"
    sb.files.write("/work/hello.txt", b"replaced")
    assert sb.files.read("/work/hello.txt") == "replaced"


def test_write_creates_parents_and_sets_mode(sb) -> None:
    sb.files.write("/work/a/b/c/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.files.get_info("/work/a/b/c/run.sh").mode == 0o755
    assert sb.commands.run("/work/a/b/c/run.sh").stdout == "ran\n"
    assert sb.files.get_info("/work/a/b/c/run.sh").permissions == "rwxr-xr-x"


def test_write_files(sb) -> None:
    out = sb.files.write_files([{"path": "/work/m/1", "data": "one"}, {"path": "/work/m/2", "data": b"two"}])
    assert [w.path for w in out] == ["/work/m/1", "/work/m/2"]
    assert sb.commands.run("cat /work/m/1 /work/m/2").stdout == "onetwo"


def test_50_mib_streamed_upload_and_download(sb, tmp_path) -> None:
    src = tmp_path / "big.bin"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for i in range(50):
            chunk = hashlib.sha256(str(i).encode()).digest() * (1 << 15)  # 1 MiB
            h.update(chunk)
            f.write(chunk)
    want = h.hexdigest()
    info = sb.files.upload(src, "/work/big.bin")
    assert info.bytes == 50 << 20
    assert sb.commands.run("sha256sum /work/big.bin").stdout.split()[0] == want
    dst = tmp_path / "back.bin"
    assert sb.files.download("/work/big.bin", dst) == 50 << 20
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == want
    # and as a stream of chunks, never the whole file in memory
    h2, n, biggest = hashlib.sha256(), 0, 0
    for chunk in sb.files.read("/work/big.bin", format="stream"):
        h2.update(chunk)
        n += len(chunk)
        biggest = max(biggest, len(chunk))
    assert (n, h2.hexdigest()) == (50 << 20, want) and biggest <= 1 << 20
    # a generator as the body
    gen = (bytes([i]) * (1 << 20) for i in range(8))
    assert sb.files.write("/work/gen.bin", gen).bytes == 8 << 20


def test_list_exists_get_info(sb) -> None:
    sb.files.write("/work/ls/f1", "1")
    sb.files.write("/work/ls/sub/f2", "22")
    entries = {e.name: e for e in sb.files.list("/work/ls")}
    assert set(entries) == {"f1", "sub"}
    assert entries["f1"].type == shoal.FileType.FILE and entries["f1"].size == 1 and entries["f1"].path == "/work/ls/f1"
    assert entries["sub"].is_dir and entries["sub"].path == "/work/ls/sub"
    assert entries["f1"].modified_time is not None
    assert sb.files.exists("/work/ls/sub/f2") and not sb.files.exists("/work/ls/nope")
    assert sb.files.get_info("/work/ls/sub").type == shoal.FileType.DIR
    with pytest.raises(shoal.NotFound) as e:
        sb.files.get_info("/work/ls/nope")
    assert not isinstance(e.value, shoal.SandboxNotFound)
    with pytest.raises(shoal.NotFound):
        sb.files.list("/work/nope")


def test_remove_and_make_dir(sb) -> None:
    assert sb.files.make_dir("/work/d1/d2") is True
    assert sb.files.make_dir("/work/d1/d2") is False
    assert sb.files.get_info("/work/d1/d2").is_dir
    sb.files.write("/work/d1/d2/f", "x")
    sb.files.write("/work/file", "x")
    with pytest.raises(shoal.AlreadyExists):
        sb.files.make_dir("/work/file")
    sb.files.remove("/work/file")
    assert not sb.files.exists("/work/file")
    with pytest.raises(shoal.FailedPrecondition, match="recursive"):
        sb.files.remove("/work/d1", recursive=False)  # not empty: a state to change, not a name taken
    sb.files.remove("/work/d1")  # recursive by default, as in E2B
    assert not sb.files.exists("/work/d1")
    with pytest.raises(shoal.NotFound):
        sb.files.remove("/work/d1")


def test_rename(sb) -> None:
    sb.files.write("/work/old.txt", "moved")
    info = sb.files.rename("/work/old.txt", "/work/new.txt")
    assert info.path == "/work/new.txt" and sb.files.read("/work/new.txt") == "moved"
    assert not sb.files.exists("/work/old.txt")


@pytest.mark.parametrize("bad", ["/work/../etc/passwd", "/..", "relative/path", ""])
def test_bad_paths_are_refused(sb, bad) -> None:
    for call in (
        lambda: sb.files.read(bad),
        lambda: sb.files.write(bad, "x"),
        lambda: sb.files.list(bad),
        lambda: sb.files.exists(bad),
        lambda: sb.files.make_dir(bad),
        lambda: sb.files.remove(bad),
    ):
        with pytest.raises(shoal.InvalidArgument):
            call()


def test_missing_file(sb) -> None:
    with pytest.raises(shoal.NotFound) as e:
        sb.files.read("/work/absent")
    assert "absent" in str(e.value) and not isinstance(e.value, shoal.SandboxNotFound)
    with pytest.raises(shoal.NotFound):
        sb.files.read("/work/absent", format="stream")
