"""Damage a stored chunk on disk the way a bad disk or a crash would (fault injection for e2e tests).

The engines' directories use the file-per-key backend (``conftest.store_section``), so a chunk is
one record file: flipping a payload byte makes it read back CORRUPT; removing it makes it missing.
Call these only while no engine holds the directory.
"""

from __future__ import annotations

from pathlib import Path

from mooncake_connector.keys import chunk_hashes
from store_backend.config import SsdConfig
from store_backend.ssd.factory import open_ssd_backend
from store_backend.ssd.record import HEADER_BLOCK
from tests.vllm_plugin.conftest import CHUNK_TOKENS


def _chunk_key(backend, tokens: list[int], chunk: int) -> str:  # noqa: ANN001
    by_hash = {k.rsplit("/", 1)[1]: k for k in backend.keys()}
    return by_hash[chunk_hashes(tokens, CHUNK_TOKENS)[chunk]]


def damage_chunk(ssd_dir: Path, tokens: list[int], chunk: int) -> None:
    """Flip one byte inside the payload of ``tokens``' chunk ``chunk``."""
    backend = open_ssd_backend(SsdConfig(path=str(ssd_dir), backend="file", io_engine="posix"))
    try:
        path = backend.path_for(_chunk_key(backend, tokens, chunk))
    finally:
        backend.close()
    with open(path, "r+b") as f:
        f.seek(HEADER_BLOCK + 1000)
        byte = f.read(1)
        f.seek(HEADER_BLOCK + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def delete_chunk(ssd_dir: Path, tokens: list[int], chunk: int) -> None:
    """Remove ``tokens``' chunk ``chunk`` from the directory."""
    backend = open_ssd_backend(SsdConfig(path=str(ssd_dir), backend="file", io_engine="posix"))
    try:
        assert backend.remove([_chunk_key(backend, tokens, chunk)])[0].ok
    finally:
        backend.close()
