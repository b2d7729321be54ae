"""Text for people: the sizes the ``status`` commands print (the node's and the pool's tables)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes as "512 B", "1.5 KiB", ... up to TiB (larger counts stay in TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
