from __future__ import annotations

import hashlib

import numpy as np


def payload(key: str, size: int) -> np.ndarray:
    """Deterministic bytes for a key, so any reader can check what it got."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
