"""What the router's legs share about failing: an instance that could not be reached, and the
OpenAI-shaped error answer."""

from __future__ import annotations

import msgspec
from aiohttp import web

JSON = "application/json"


class Unreachable(Exception):
    """The chosen instance could not be reached before anything was sent."""


def error(status: int, message: str, **headers: str) -> web.Response:
    """An OpenAI-shaped error answer (``{"error": {"message", "code"}}``) with ``headers``."""
    return web.Response(status=status, body=msgspec.json.encode({"error": {"message": message, "code": status}}),
                        content_type=JSON, headers=headers)
