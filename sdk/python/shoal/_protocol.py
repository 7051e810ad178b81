"""The wire, without I/O: Connect envelopes, error replies, retry policy,
request bodies and the state of a command's event stream. Shared by the sync
and the asyncio clients, so both speak exactly the same protocol."""

from __future__ import annotations

import base64
import codecs
import json
import random
import re
import struct
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import httpx

from .exceptions import (
    CommandExitException,
    CommandTimeout,
    ConnectionLost,
    InvalidArgument,
    NotSupported,
    ShoalError,
    Timeout,
    Unavailable,
    error_for,
)
from .models import CommandResult, Environment, Layer, PtySize

# Small stdin travels inside the Exec request; larger or streamed stdin is
# sent with SendStdin in chunks of STDIN_CHUNK.
INLINE_STDIN = 1 << 20
STDIN_CHUNK = 256 << 10
FILE_CHUNK = 1 << 20

# --- Connect envelopes (server streaming over HTTP/1.1) ---

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02


def envelope(msg: Mapping[str, Any]) -> bytes:
    """One Connect envelope: flags byte, 4-byte big-endian length, JSON."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">BI", 0, len(data)) + data


class EnvelopeDecoder:
    """Splits a byte stream into Connect envelopes, fed in arbitrary pieces."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[Tuple[int, bytes]]:
        self._buf += data
        out = []
        while len(self._buf) >= 5:
            flags, n = struct.unpack_from(">BI", self._buf)
            if len(self._buf) < 5 + n:
                break
            out.append((flags, bytes(self._buf[5 : 5 + n])))
            del self._buf[: 5 + n]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


class StreamEnd(Exception):
    """The server ended the stream normally."""


# Error metadata that names an error more precisely than its code.
REASON_HEADER = "shoal-error-reason"


def metadata_reason(meta: Any) -> Optional[str]:
    """The Shoal-Error-Reason of an end-of-stream message's metadata (a JSON
    object of lists) or of HTTP headers."""
    if not meta:
        return None
    if isinstance(meta, httpx.Headers):
        return meta.get(REASON_HEADER)
    for k, v in meta.items():
        if str(k).lower() == REASON_HEADER:
            return (v[0] if isinstance(v, list) and v else v) or None
    return None


def decode_message(flags: int, payload: bytes, *, sandbox_call: bool = False, trajectory: bool = False) -> Dict[str, Any]:
    """Decode one envelope into a message; raises StreamEnd at a clean end,
    or the server's error carried by the end-of-stream envelope."""
    if flags & FLAG_COMPRESSED:
        raise ShoalError("server sent a compressed stream message, which this client did not ask for", code="internal")
    try:
        msg = json.loads(payload) if payload else {}
    except ValueError as e:
        raise ShoalError(f"bad JSON in stream message: {e}", code="internal") from None
    if flags & FLAG_END_STREAM:
        err = msg.get("error")
        if err:
            raise error_for(
                err.get("code", "unknown"),
                err.get("message", ""),
                sandbox_call=sandbox_call,
                trajectory=trajectory,
                reason=metadata_reason(msg.get("metadata")),
            )
        raise StreamEnd()
    return msg


def decode_ndjson(line: Union[str, bytes]) -> Dict[str, Any]:
    """One line of an NDJSON reply (the upload build): a message, or the
    server's error ({"error": {"code", "message"}}, raised)."""
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise ShoalError(f"bad JSON in a reply line: {e}", code="internal") from None
    if not isinstance(msg, dict):
        raise ShoalError(f"bad reply line: {line!r}", code="internal")
    err = msg.get("error")
    if err:
        raise error_for(err.get("code", "unknown"), err.get("message", ""))
    return msg


# --- errors of unary calls and plain HTTP endpoints ---

# What Connect clients assume when an HTTP error carries no Connect error body.
_HTTP_CODES = {
    400: "internal",
    401: "unauthenticated",
    403: "permission_denied",
    404: "unimplemented",
    408: "deadline_exceeded",
    429: "unavailable",
    502: "unavailable",
    503: "unavailable",
    504: "unavailable",
}


def http_error(
    status: int,
    body: bytes,
    *,
    what: str = "",
    sandbox_call: bool = False,
    trajectory: bool = False,
    reason: Optional[str] = None,
) -> ShoalError:
    """The exception for an HTTP error reply (a Connect JSON error body, or not)."""
    code = msg = None
    try:
        d = json.loads(body)
        if isinstance(d, dict):
            code, msg = d.get("code"), d.get("message")
    except ValueError:
        pass
    if not code:
        code = _HTTP_CODES.get(status, "unknown")
        text = body.decode(errors="replace").strip()[:500]
        if code == "unimplemented":
            msg = f"this Shoal server does not implement {what or 'this call'} (HTTP 404: {text})"
        else:
            msg = f"HTTP {status}" + (f" from {what}" if what else "") + (f": {text}" if text else "")
    return error_for(code, msg or code, status=status, sandbox_call=sandbox_call, trajectory=trajectory, reason=reason)


def transport_error(e: Exception, url: str) -> ShoalError:
    """The exception for an httpx transport failure (no reply from the server)."""
    if isinstance(e, httpx.TimeoutException):
        return Timeout(f"no reply from Shoal at {url} in time ({type(e).__name__}: {e})")
    if isinstance(e, httpx.ConnectError):
        return Unavailable(f"cannot connect to Shoal at {url}: {e}")
    return ConnectionLost(f"connection to Shoal at {url} lost: {type(e).__name__}: {e}")


# --- retries ---

RETRY_CODES = frozenset({"resource_exhausted", "unavailable"})


def retryable(exc: BaseException, idempotent: bool) -> bool:
    """Whether a failed attempt may be repeated.

    A connection that could not be opened never reached the server, so any
    call may be repeated. Everything else (capacity refusals, an unavailable
    server, a connection lost mid-call) is repeated only for idempotent
    calls: reads, deletes, and creates and commands carrying a client key or
    a trajectory step.
    """
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return True
    if not idempotent:
        return False
    if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, ConnectionLost)):
        return True
    if isinstance(exc, ShoalError) and exc.code in RETRY_CODES and not isinstance(exc, ConnectionLost):
        return True
    return False


def backoff(attempt: int, retry_after: Optional[float] = None) -> float:
    """Seconds to sleep before retry number `attempt` (0-based): exponential
    from 100 ms, capped at 5 s, with full jitter; a server's Retry-After wins."""
    if retry_after is not None and retry_after >= 0:
        return min(retry_after, 30.0)
    return random.uniform(0, min(5.0, 0.1 * (2**attempt)))


def retry_after(resp: Optional[httpx.Response]) -> Optional[float]:
    if resp is None:
        return None
    v = resp.headers.get("retry-after")
    try:
        return float(v) if v else None
    except ValueError:
        return None


# --- request bodies ---

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(I?)(B?)\s*$", re.I)


def parse_memory(v: Union[str, int, float, None], what: str = "memory") -> Optional[int]:
    """'512M', '1.5G', '65536', 2**30 -> bytes (binary units, like the CLI)."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise InvalidArgument(f"{what} {v!r} must be bytes or a size such as '512M'")
    if isinstance(v, (int, float)):
        if v < 0:
            raise InvalidArgument(f"{what} {v!r} must not be negative")
        return int(v)
    if not isinstance(v, str):
        raise InvalidArgument(f"{what} {v!r} must be bytes or a size such as '512M'")
    m = _SIZE.match(v)
    if not m:
        raise InvalidArgument(f"{what} {v!r} must look like '512M', '2G' or a number of bytes")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)


def seconds(v: Union[int, float, timedelta, None], what: str) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, timedelta):
        v = v.total_seconds()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(f"{what} {v!r} must be a number of seconds")
    if v < 0:
        raise InvalidArgument(f"{what} must not be negative")
    return float(v)


def create_body(
    *,
    template: Optional[str],
    base: Optional[str],
    workspaces: Optional[Sequence[str]],
    toolkits: Optional[Sequence[str]],
    backend: Optional[str],
    cpus: Optional[float],
    memory: Union[str, int, None],
    timeout: Union[int, float, timedelta, None],
    disk: Union[str, int, None] = None,
    log_budget: Union[str, int, None] = None,
    metadata: Optional[Mapping[str, str]],
    envs: Optional[Mapping[str, str]],
    qos: Optional[str],
    client_key: Optional[str],
    allow_internet_access: bool = False,
    allow_out: Optional[Sequence[str]] = None,
    deny_out: Optional[Sequence[str]] = None,
    auto_pause: Union[int, float, timedelta, None] = None,
) -> Dict[str, Any]:
    if qos is not None and qos not in ("ls", "be"):
        raise InvalidArgument(f"qos {qos!r}: want 'ls' (latency-sensitive, the default) or 'be' (best effort)")
    if isinstance(workspaces, str) or isinstance(toolkits, str):
        raise InvalidArgument("workspaces and toolkits are lists of layer refs")
    body: Dict[str, Any] = {}
    if template:
        body["template"] = template.name if isinstance(template, Environment) else template
    if base:
        body["base"] = layer_ref(base)
    if workspaces:
        body["workspaces"] = [layer_ref(r) for r in workspaces]
    if toolkits:
        body["toolkits"] = [layer_ref(r) for r in toolkits]
    if backend:
        body["backend"] = backend
    if cpus is not None:
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0:
            raise InvalidArgument(f"cpus {cpus!r} must be a positive number of cores (e.g. 0.5, 2)")
        body["millicpu"] = str(max(1, round(cpus * 1000)))
    mem = parse_memory(memory)
    if mem:
        body["memoryBytes"] = str(mem)
    dsk = parse_memory(disk, "disk")
    if dsk:
        body["diskBytes"] = str(dsk)
    lb = parse_memory(log_budget, "log_budget")
    if lb:
        body["logBudgetBytes"] = str(lb)
    t = seconds(timeout, "timeout")
    if t:
        body["timeoutSeconds"] = str(max(1, int(t)))
    if metadata:
        body["metadata"] = {str(k): str(v) for k, v in metadata.items()}
    if envs:
        body["env"] = {str(k): str(v) for k, v in envs.items()}
    if qos:
        body["qos"] = qos
    if client_key:
        body["clientKey"] = client_key
    if isinstance(allow_out, str) or isinstance(deny_out, str):
        raise InvalidArgument("allow_out and deny_out are lists of CIDRs")
    if allow_internet_access or allow_out or deny_out:
        net: Dict[str, Any] = {}
        if allow_internet_access:
            net["internet"] = True
        if allow_out:
            net["allowOut"] = [str(x) for x in allow_out]
        if deny_out:
            net["denyOut"] = [str(x) for x in deny_out]
        body["network"] = net
    if auto_pause is not None:
        a = seconds(auto_pause, "auto_pause")
        if a and a < 1:
            raise InvalidArgument("auto_pause must be 0 (never) or at least 1 second")
        body["autoPauseSeconds"] = str(int(a))
    return body


def layer_ref(ref: Any) -> str:
    """A layer reference: a string as given, a :class:`Layer` by its digest
    (``name@sha256:...``: exactly that image, whatever its tag names now)."""
    return ref.pinned if isinstance(ref, Layer) else ref


def argv(cmd: Union[str, Sequence[str]]) -> List[str]:
    """A string runs with `sh -c`; a list is the argv itself."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("command is empty")
        return ["sh", "-c", cmd]
    args = [str(a) for a in cmd]
    if not args:
        raise InvalidArgument("command argv is empty")
    return args


StdinArg = Union[None, bool, str, bytes, bytearray, memoryview, Any]


def split_stdin(stdin: StdinArg) -> Tuple[Optional[bytes], bool, Any]:
    """-> (inline bytes, keep stdin open, a source to stream with SendStdin).

    ``True`` keeps stdin open for ``send_stdin``; ``str``/``bytes`` up to
    1 MiB travel inside the request; larger data, file objects and
    iterables of bytes are streamed after the command starts.
    """
    if stdin is None or stdin is False:
        return None, False, None
    if stdin is True:
        return None, True, None
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        b = bytes(stdin)
        if len(b) <= INLINE_STDIN:
            return b, False, None
        return None, True, b
    if hasattr(stdin, "read") or hasattr(stdin, "__iter__") or hasattr(stdin, "__aiter__"):
        return None, True, stdin
    raise InvalidArgument(f"stdin must be bytes, str, True, a file object or an iterable of bytes, not {type(stdin).__name__}")


def exec_body(
    sandbox_id: str,
    args: List[str],
    *,
    envs: Optional[Mapping[str, str]] = None,
    cwd: Optional[str] = None,
    stdin: Optional[bytes] = None,
    stdin_open: bool = False,
    timeout: Union[int, float, timedelta, None] = None,
    pty: Optional[PtySize] = None,
    trajectory_id: Optional[str] = None,
    step: Optional[int] = None,
    user: Optional[str] = None,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"sandboxId": sandbox_id, "args": args}
    if user:
        body["user"] = user
    if envs:
        body["env"] = {str(k): str(v) for k, v in envs.items()}
    if cwd:
        body["cwd"] = cwd
    if stdin:
        body["stdin"] = base64.b64encode(stdin).decode()
    if stdin_open:
        body["stdinOpen"] = True
    t = seconds(timeout, "timeout")
    if t:
        body["timeoutMs"] = str(max(1, int(t * 1000)))
    if pty is not None:
        body["pty"] = {"rows": int(pty.rows), "cols": int(pty.cols)}
    if trajectory_id:
        body["trajectoryId"] = trajectory_id
        body["step"] = str(int(step or 0))
    return body


def b64(data: Union[str, bytes]) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(bytes(data)).decode()


def file_mode(mode: Optional[int]) -> Optional[str]:
    if mode is None:
        return None
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise InvalidArgument(f"mode {mode!r} must be permission bits such as 0o644")
    return "%04o" % mode


def check_path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise InvalidArgument("a path is required")
    return path


# --- one command's event stream ---

# (stdout text, stderr text, pty bytes): exactly one is not None (E2B's shape).
Output = Tuple[Optional[str], Optional[str], Optional[bytes]]


class CommandState:
    """Folds a command's events (started, stdout, stderr, exit, ...) into
    its output and result, tracking the log offset for re-connecting."""

    def __init__(self, *, pty: bool = False, command_id: str = "", step: int = 0) -> None:
        self.pty = pty
        self.command_id = command_id
        self.step = step
        self.pid = 0
        self.replayed = False
        self.offset = 0
        self.offsets_seen = False
        self.output_seen = False
        self.exit: Optional[Dict[str, Any]] = None
        self.dropped = 0
        self._out = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._err = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stdout: List[str] = []
        self._stderr: List[str] = []
        self._flushed = False

    @property
    def started(self) -> bool:
        return bool(self.command_id)

    @property
    def done(self) -> bool:
        return self.exit is not None

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def can_resume(self) -> bool:
        """A broken stream can be continued without losing or repeating a byte."""
        return bool(self.command_id) and (self.offsets_seen or not self.output_seen)

    def feed(self, msg: Mapping[str, Any]) -> List[Output]:
        if "offset" in msg:
            self.offset = int(msg["offset"])
            self.offsets_seen = True
        out: List[Output] = []
        if "started" in msg:
            s = msg["started"] or {}
            self.command_id = self.command_id or s.get("commandId", "")
            self.pid = int(s.get("pid") or self.pid or 0)
            self.replayed = self.replayed or bool(s.get("replayed"))
        elif "stdout" in msg:
            data = base64.b64decode(msg["stdout"] or "")
            self.output_seen = True
            text = self._out.decode(data)
            if text:
                self._stdout.append(text)
            if self.pty:
                out.append((None, None, data))
            elif text:
                out.append((text, None, None))
        elif "stderr" in msg:
            data = base64.b64decode(msg["stderr"] or "")
            self.output_seen = True
            text = self._err.decode(data)
            if text:
                self._stderr.append(text)
                out.append((None, text, None))
        elif "dropped" in msg:
            self.dropped += int((msg["dropped"] or {}).get("bytes") or 0)
        elif "exit" in msg:
            self.exit = msg["exit"] or {}
            out.extend(self.flush())
        return out

    def flush(self) -> List[Output]:
        if self._flushed:
            return []
        self._flushed = True
        out: List[Output] = []
        t = self._out.decode(b"", final=True)
        if t:
            self._stdout.append(t)
            if not self.pty:
                out.append((t, None, None))
        t = self._err.decode(b"", final=True)
        if t:
            self._stderr.append(t)
            out.append((None, t, None))
        return out

    def result(self) -> CommandResult:
        ex = self.exit or {}
        code = int(ex.get("code") or 0)
        sig = ex.get("signal", "") or ""
        timed_out = bool(ex.get("timedOut"))
        error = None
        if timed_out:
            error = "timed out"
        elif sig:
            error = f"killed by {sig}"
        return CommandResult(
            stdout=self.stdout,
            stderr=self.stderr,
            exit_code=code,
            error=error,
            command_id=self.command_id,
            pid=self.pid,
            signal=sig,
            timed_out=timed_out,
            replayed=self.replayed,
            step=self.step,
            dropped_bytes=int(ex.get("droppedBytes") or 0) or self.dropped,
        )


def checked(result: CommandResult, check: bool) -> CommandResult:
    """Raise for a failed command when `check` (E2B's default behaviour)."""
    if check:
        if result.timed_out:
            raise CommandTimeout(result)
        if result.exit_code != 0:
            raise CommandExitException(result)
    return result


def chunks(data: bytes, size: int = STDIN_CHUNK) -> Iterable[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]
