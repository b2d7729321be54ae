"""Which engine versions the connectors are written and tested against, and the warning for others.

The engines' connector interfaces change between minor releases (a hook gains an argument, a class
moves), so a plugin started on an untested version may fail inside a hook with a TypeError or an
AttributeError. Each plugin calls :func:`check_engine_version` once at start: a version outside the
tested series is logged as a WARNING naming both versions and what to install; nothing is refused,
since a newer release often keeps the interface. Pure, except for the log line.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# engine -> (series a version must start with, the exact version the tests run)
TESTED: dict[str, tuple[str, str]] = {
    "vllm": ("0.32.", "0.32.0"),
    "sglang": ("0.5.", "0.5.23"),
}


def version_note(engine: str, installed: str) -> str | None:
    """None when ``installed`` is in the tested series of ``engine`` ("vllm", "sglang"), else the
    warning text. Local build tags (``0.32.0+cpu``) count as their release."""
    series, exact = TESTED[engine]
    if installed.startswith(series):
        return None
    return (f"{engine} {installed} is not a version this project is tested with ({series}x, tested {exact}); "
            f"if a connector hook fails with a TypeError or AttributeError, install {engine}=={exact}")


_warned: set[str] = set()


def check_engine_version(engine: str, installed: str) -> None:
    """Log :func:`version_note` as a WARNING, once per engine and process."""
    note = version_note(engine, installed)
    if note is not None and engine not in _warned:
        _warned.add(engine)
        logger.warning("%s", note)
