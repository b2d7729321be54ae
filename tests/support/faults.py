"""Fault injection on a real object's public methods, for the length of a ``with`` block.

The object stays the same object (callers that hold it, or check its type, see no wrapper); only
the named methods are replaced on the instance, and put back (the class's own) on exit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


@contextmanager
def wrapped_calls(obj: object, **wraps: Wrap) -> Iterator[None]:
    """Replace each method ``name`` of ``obj`` by ``wrap(original bound method)`` inside the
    block; a wrap of None hides the method (``getattr`` answers None: not callable)."""
    for name, wrap in wraps.items():
        setattr(obj, name, None if wrap is None else wrap(getattr(obj, name)))
    try:
        yield
    finally:
        for name in wraps:
            delattr(obj, name)


def raises_once(exc: BaseException) -> Wrap:
    """A wrap whose first call raises ``exc`` before the original sees it (a call whose transport
    broke); later calls go through."""
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        fired: list[bool] = []

        def call(*a: Any, **kw: Any) -> Any:
            if not fired:
                fired.append(True)
                raise exc
            return orig(*a, **kw)
        return call
    return wrap


def returns(fn: Callable[..., Any]) -> Wrap:
    """A wrap that answers ``fn(original, *args, **kwargs)``."""
    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            return fn(orig, *a, **kw)
        return call
    return wrap
