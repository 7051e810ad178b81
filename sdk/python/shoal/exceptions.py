"""Exceptions raised by the Shoal SDK.

Every error the server reports arrives as a subclass of :class:`ShoalError`
named for what happened, carrying the server's message (``str(err)``), its
Connect code (``err.code``, e.g. ``"not_found"``) and the HTTP status.

E2B's names are kept as aliases (``SandboxException``, ``NotFoundException``,
``TimeoutException``, ``AuthenticationException``,
``InvalidArgumentException``), so code written against E2B's SDK catches the
same errors.
"""

from __future__ import annotations

import re
from typing import Optional


class ShoalError(Exception):
    """Base class of every error raised by the SDK.

    :ivar code: the Connect/gRPC code the server sent (``"not_found"``,
        ``"invalid_argument"``, ...), or a client-side code such as
        ``"unavailable"`` for a connection failure.
    :ivar message: the server's message, which says what to fix.
    :ivar status: the HTTP status of the reply, if there was one.
    """

    default_code = "unknown"

    def __init__(self, message: str = "", *, code: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status = status

    def __str__(self) -> str:
        return self.message


class NotFound(ShoalError):
    """The thing named does not exist (a file, a command, a layer, ...)."""

    default_code = "not_found"


class SandboxNotFound(NotFound):
    """The sandbox does not exist (never did, was killed, or timed out)."""


class SandboxKilled(SandboxNotFound):
    """The sandbox was deleted while a command ran in it: killed by a client
    (``sandbox.kill()``, ``shoal rm``) or by its timeout. The command did not
    exit, it was killed with its sandbox, so there is no exit code; the
    output received until then was delivered.

    Raised by ``commands.run()``, ``CommandHandle.wait()`` and iteration,
    ``commands.wait()`` and ``commands.connect(...).wait()``; the message
    names the sandbox (``err.sandbox_id``). A subclass of
    :class:`SandboxNotFound`: the sandbox is gone, as every later call about
    it will say.
    """

    def __init__(self, message: str = "", *, code: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message, code=code, status=status)
        m = re.search(r"sandbox (\S+) was killed", message)
        self.sandbox_id: Optional[str] = m.group(1) if m else None


class CommandNotFound(NotFound):
    """A command could not start: its executable does not exist (no such
    file, or not found in ``PATH``). A shell would exit 127; ``shoal exec``
    does."""


class CommandNotExecutable(ShoalError):
    """A command could not start: its executable exists but cannot be
    executed (a directory, no execute permission, not a binary). A shell
    would exit 126; ``shoal exec`` does. ``code`` is the server's
    (``permission_denied`` or ``invalid_argument``)."""

    default_code = "permission_denied"


class LayerNotFound(NotFound):
    """No layer has the tag or digest named (in a layer call, or in a create's
    base, workspaces, toolkits or environment)."""


class InvalidArgument(ShoalError):
    """The request was refused because an argument is wrong; the message says which."""

    default_code = "invalid_argument"


class LogPruned(InvalidArgument):
    """A command's output was read from an offset its sandbox's log budget
    pruned (its oldest output goes first). ``offset`` is the first offset
    kept: read (re-attach) from there. Code ``out_of_range``."""

    default_code = "out_of_range"

    def __init__(self, message: str = "", *, code: Optional[str] = None, status: Optional[int] = None) -> None:
        super().__init__(message, code=code, status=status)
        m = re.search(r"re-attach from offset (\d+)", message)
        self.offset: Optional[int] = int(m.group(1)) if m else None


class AlreadyExists(ShoalError):
    """The thing to create exists already."""

    default_code = "already_exists"


class FailedPrecondition(ShoalError):
    """The request is valid but the target is not in a state that allows it."""

    default_code = "failed_precondition"


class CommandReset(FailedPrecondition):
    """The command (or shell) was closed by a reset of its sandbox
    (``sandbox.reset()``, ``shoal reset``): its process was killed and its
    writable layer replaced; the sandbox lives on. There is no exit code.

    Raised by ``CommandHandle.wait()`` and iteration, ``commands.wait()``
    and ``commands.connect(...).wait()``."""


class TrajectoryDiverged(FailedPrecondition):
    """A trajectory step was re-sent with a different request than the one recorded.

    The script that owns the trajectory no longer does what it did when the
    step was first run; fast-forwarding through recorded steps is only
    correct when the same steps are sent in the same order.
    """


class LayerInUse(FailedPrecondition):
    """A layer image cannot be removed: a sandbox or an environment uses it,
    or it is mounted. The message says by whom; ``layers.gc()`` removes it
    once nothing does."""


class Aborted(ShoalError):
    """The operation was cut short (``aborted``): e.g. a command was lost
    because its sandbox's agent restarted and no longer knows it."""

    default_code = "aborted"


class PermissionDenied(ShoalError):
    """The operation is not permitted (e.g. a file the sandbox may not write)."""

    default_code = "permission_denied"


class AuthError(ShoalError):
    """The API key is missing or wrong (HTTP 401)."""

    default_code = "unauthenticated"


class CapacityExhausted(ShoalError):
    """The server refused the work for lack of capacity (``resource_exhausted``).

    Idempotent calls are retried with back-off before this is raised.
    """

    default_code = "resource_exhausted"


class Unavailable(ShoalError):
    """The server could not be reached, or said it is unavailable.

    Idempotent calls are retried with back-off before this is raised.
    """

    default_code = "unavailable"


class ConnectionLost(Unavailable):
    """The connection broke in the middle of a call, so whether the server
    acted on it is unknown. Raised only after any safe retry or re-attach
    (a running command is re-attached from its log offset) has failed."""


class Timeout(ShoalError):
    """A deadline passed: a request took too long, or a command ran past its timeout."""

    default_code = "deadline_exceeded"


class Canceled(ShoalError):
    """The call was canceled."""

    default_code = "canceled"


class NotSupported(ShoalError):
    """The server does not implement this call (``unimplemented``), or the
    sandbox's backend cannot do it."""

    default_code = "unimplemented"


class ServerError(ShoalError):
    """The server failed (``internal``, ``unknown``, ``data_loss``)."""

    default_code = "internal"


class CommandExitException(ShoalError):
    """A command exited with a non-zero code (E2B's name and behaviour).

    Raised by ``commands.run()`` and ``CommandHandle.wait()`` unless they are
    called with ``check=False``. Carries the whole result, so nothing is lost:
    ``exit_code``, ``stdout``, ``stderr``, ``error`` and ``result``.
    """

    default_code = "command_exit"

    def __init__(self, result: "CommandResult") -> None:  # noqa: F821 (models imports us)
        self.result = result
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr
        self.error = result.error
        what = f"command exited with code {result.exit_code}"
        if result.signal:
            what += f" ({result.signal})"
        tail = result.stderr.strip()[-2000:]
        super().__init__(what + (f": {tail}" if tail else ""))


class CommandTimeout(CommandExitException, Timeout):
    """A command ran past its ``timeout`` and was killed (its process group)."""

    default_code = "deadline_exceeded"

    def __init__(self, result: "CommandResult") -> None:  # noqa: F821
        super().__init__(result)
        self.code = "deadline_exceeded"
        self.message = f"command timed out and was killed (exit code {result.exit_code})"
        self.args = (self.message,)


# E2B's names for the same errors.
SandboxException = ShoalError
NotFoundException = NotFound
TimeoutException = Timeout
AuthenticationException = AuthError
InvalidArgumentException = InvalidArgument

_BY_CODE = {
    "not_found": NotFound,
    "invalid_argument": InvalidArgument,
    "out_of_range": InvalidArgument,
    "already_exists": AlreadyExists,
    "failed_precondition": FailedPrecondition,
    "aborted": Aborted,
    "permission_denied": PermissionDenied,
    "unauthenticated": AuthError,
    "resource_exhausted": CapacityExhausted,
    "unavailable": Unavailable,
    "deadline_exceeded": Timeout,
    "canceled": Canceled,
    "unimplemented": NotSupported,
    "internal": ServerError,
    "unknown": ServerError,
    "data_loss": ServerError,
}

# Messages with which the server reports a missing sandbox (internal/node),
# a sandbox killed under a command (internal/session), a missing layer and a
# layer in use (internal/layer).
_SANDBOX_MISSING = ("no sandbox ", "is not a sandbox id")
_SANDBOX_KILLED = " was killed (deleted) while "
# The reason (error metadata Shoal-Error-Reason) of a sandbox killed under an
# operation (internal/control.ReasonSandboxKilled).
REASON_SANDBOX_KILLED = "sandbox_killed"
# A command's executable is missing / not executable
# (internal/control.ReasonCommandNotFound, ReasonCommandNotExecutable).
REASON_COMMAND_NOT_FOUND = "command_not_found"
REASON_COMMAND_NOT_EXECUTABLE = "command_not_executable"
# Output read from where the log budget pruned it
# (internal/control.ReasonLogPruned).
REASON_LOG_PRUNED = "log_pruned"
# A command or shell closed by a reset of its sandbox
# (internal/control.ReasonSandboxReset).
REASON_SANDBOX_RESET = "sandbox_reset"
_SANDBOX_RESET = " was closed by a reset of sandbox "
_LAYER_MISSING = "layer not found"
_LAYER_IN_USE = "layer in use"


def error_for(
    code: str,
    message: str,
    *,
    status: Optional[int] = None,
    sandbox_call: bool = False,
    trajectory: bool = False,
    reason: Optional[str] = None,
) -> ShoalError:
    """Build the exception for a server error.

    :param sandbox_call: the call targets the sandbox itself (get, delete,
        set_timeout...), so ``not_found`` means the sandbox is gone.
    :param trajectory: the call carried a trajectory step, so a refusal of
        the step means the trajectory diverged.
    :param reason: the error's Shoal-Error-Reason metadata, if any.
    """
    cls = _BY_CODE.get(code, ServerError)
    if reason == REASON_COMMAND_NOT_FOUND:
        return CommandNotFound(message, code=code, status=status)
    if reason == REASON_COMMAND_NOT_EXECUTABLE:
        return CommandNotExecutable(message, code=code, status=status)
    if reason == REASON_LOG_PRUNED or (code == "out_of_range" and "re-attach from offset" in message):
        return LogPruned(message, code=code, status=status)
    if reason == REASON_SANDBOX_RESET or (code == "failed_precondition" and _SANDBOX_RESET in message):
        return CommandReset(message, code=code, status=status)
    if cls is NotFound:
        low = message.lower()
        if reason == REASON_SANDBOX_KILLED or _SANDBOX_KILLED in message:
            cls = SandboxKilled
        elif sandbox_call or any(m in low for m in _SANDBOX_MISSING):
            cls = SandboxNotFound
        elif _LAYER_MISSING in low:
            cls = LayerNotFound
    elif cls is FailedPrecondition and _LAYER_IN_USE in message.lower():
        cls = LayerInUse
    if trajectory and code == "failed_precondition":
        cls = TrajectoryDiverged  # "trajectory T step N diverged: ..."
    return cls(message, code=code, status=status)
