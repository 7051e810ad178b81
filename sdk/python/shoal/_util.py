"""Small helpers shared by the sync and async clients."""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Generic, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class instance_or_class(Generic[F]):
    """A method callable on an instance (``sb.kill()``) or on the class with
    an ID (``Sandbox.kill(sandbox_id)``), as E2B's SDK allows.

    On the class, the attribute is the classmethod named ``class_impl``.
    """

    def __init__(self, class_impl: str) -> None:
        self.class_impl = class_impl
        self.func: Optional[Callable[..., Any]] = None

    def __call__(self, func: F) -> F:
        self.func = func
        functools.update_wrapper(self, func)  # type: ignore[arg-type]
        return self  # type: ignore[return-value]

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return getattr(cls, self.class_impl)
        return types.MethodType(self.func, obj)  # type: ignore[arg-type]
