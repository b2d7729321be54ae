"""Pages of SGLang's HiCache host pool seen in the project's canonical chunk layout.

SGLang keeps its host KV pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) in one of a few
layouts; the store holds each page as one canonical chunk object (:mod:`mooncake_connector.layout`:
layer-major, inside a layer ``[plane, token, head, dim]``, planes K then V, one latent plane for
MLA). :class:`HostPages` gives, for a page that starts at host index ``s``, a *view* of the host
pool's bytes with the canonical axes ``[layer, plane, token, head, word]`` (no copy), so moving a
page is one copy between that view and a flat buffer. When the view is contiguous (MLA with
``page_first_direct``) the store reads and writes the host pool directly and nothing is staged.

Host layouts (``kv`` is the pool's tensor in words; MLA pools get a leading plane axis of 1):

====================== =================================== ======================
layout                 ``kv`` shape                        page at host index s
====================== =================================== ======================
``layer_first``        ``[plane, layer, token, head, w]``  ``kv[:, :, s:s+P]``
``page_first``         ``[plane, token, layer, head, w]``  ``kv[:, s:s+P]``
``page_first_direct``  ``[plane, page, layer, P, head, w]`` ``kv[:, s // P]``
====================== =================================== ======================

The native order of a page is also the order of SGLang's "flat data page" (``get_data_page`` /
``set_from_flat_data_page``), which the legacy storage calls pass around.

Pure array code (numpy views of the pool's torch tensor), no SGLang import. Thread-safe: views only,
no state changes after construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from mooncake_connector.layout import ChunkLayout

# Host-pool layouts whose pages map onto the canonical layout with a fixed permutation.
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# Permutation from the native page order to [layer, plane, token, head, word], per layout.
_TO_CANONICAL = {
    "layer_first": (1, 0, 2, 3, 4),  # [plane, layer, token, h, b]
    "page_first": (2, 0, 1, 3, 4),  # [plane, token, layer, h, b]
    "page_first_direct": (1, 0, 2, 3, 4),  # [plane, layer, token, h, b] (page axis dropped)
}


class UnsupportedHostPoolError(ValueError):
    """A host pool whose layout or geometry this backend cannot store."""


class PoolGeometry(msgspec.Struct, frozen=True):
    """What the backend reads from SGLang's host pool at registration."""

    layout: str
    page_size: int
    num_layers: int
    num_heads: int  # KV heads of this rank (1 for MLA)
    head_size: int  # values per head and plane (MLA: kv_lora_rank + qk_rope_head_dim)
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    element_bytes: int
    is_mla: bool

    @property
    def num_planes(self) -> int:
        return 1 if self.is_mla else 2

    def chunk_layout(self) -> ChunkLayout:
        return ChunkLayout(num_layers=self.num_layers, chunk_tokens=self.page_size, num_heads=self.num_heads,
                           head_size=self.head_size, element_bytes=self.element_bytes,
                           num_planes=self.num_planes)

    @property
    def page_bytes(self) -> int:
        return self.chunk_layout().chunk_bytes

    @property
    def word_dtype(self) -> np.dtype:
        """The widest integer type that divides a head's row of bytes: pages are copied in these
        units (a byte-wise strided copy runs several times slower)."""
        row = self.head_size * self.element_bytes
        return next(np.dtype(t) for t in (np.int64, np.int32, np.int16, np.uint8) if row % np.dtype(t).itemsize == 0)

    @property
    def canonical_shape(self) -> tuple[int, int, int, int, int]:
        """A page in canonical order, in words: ``[layer, plane, token, head, word]``."""
        return (self.num_layers, self.num_planes, self.page_size, self.num_heads,
                self.head_size * self.element_bytes // self.word_dtype.itemsize)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def geometry_of(host_pool: Any, *, is_mla: bool) -> PoolGeometry:
    """Read the geometry of an SGLang host pool (raises UnsupportedHostPoolError)."""
    layout = getattr(host_pool, "layout", None)
    if layout not in SUPPORTED_LAYOUTS:
        raise UnsupportedHostPoolError(
            f"host pool layout {layout!r} is not supported; use one of {', '.join(SUPPORTED_LAYOUTS)} "
            "(--hicache-mem-layout)")
    if getattr(host_pool, "kv_buffer", None) is None:
        raise UnsupportedHostPoolError(f"{type(host_pool).__name__} holds no KV buffer (a logical pool)")
    if getattr(host_pool, "dcp_size", 1) != 1:
        raise UnsupportedHostPoolError("decode context parallel (dcp_size > 1) is not supported")
    dtype: torch.dtype = host_pool.dtype
    if is_mla:
        num_heads, head_size = 1, int(host_pool.kv_cache_dim)
    else:
        num_heads, head_size = int(host_pool.head_num), int(host_pool.head_dim)
        v_head = int(getattr(host_pool, "v_head_dim", head_size))
        if v_head != head_size:
            raise UnsupportedHostPoolError(f"K head size {head_size} differs from V head size {v_head}")
    geometry = PoolGeometry(layout=layout, page_size=int(host_pool.page_size), num_layers=int(host_pool.layer_num),
                            num_heads=num_heads, head_size=head_size, dtype=dtype_name(dtype),
                            element_bytes=dtype.itemsize, is_mla=is_mla)
    have = host_pool.kv_buffer.numel() * dtype.itemsize
    expected = geometry.page_bytes * (host_pool.size // geometry.page_size)
    if have != expected:
        raise UnsupportedHostPoolError(
            f"host pool buffer of {have} bytes does not match its geometry {geometry} ({expected} bytes)")
    return geometry


class HostPages:
    """Canonical views of the pages of one host pool. The pool must outlive this object.

    Copies run in numpy, one thread, in the caller's thread: SGLang calls from its own background
    threads, and torch's intra-op thread pool, competing with the engine for a few cores, copies
    permuted views several times slower than a single thread does.
    """

    def __init__(self, kv_buffer: torch.Tensor, geometry: PoolGeometry) -> None:
        if kv_buffer.device.type != "cpu":
            raise UnsupportedHostPoolError(f"host pool lives on {kv_buffer.device}, not in host memory")
        if not kv_buffer.is_contiguous():
            raise UnsupportedHostPoolError("host pool buffer is not contiguous")
        g = geometry
        self._word = g.word_dtype
        kv = kv_buffer.view(torch.uint8).numpy().view(self._word)
        if g.is_mla:
            kv = kv[np.newaxis]
        self.geometry = g
        self._kv = kv
        self._perm = _TO_CANONICAL[g.layout]
        self._shape = g.canonical_shape
        b = self._shape[-1]
        if g.layout == "page_first":
            self.native_page_shape = (g.num_planes, g.page_size, g.num_layers, g.num_heads, b)
        else:
            self.native_page_shape = (g.num_planes, g.num_layers, g.page_size, g.num_heads, b)
        self.page_bytes = g.page_bytes
        # Whether a page's canonical view is one contiguous range of the host pool.
        self.direct = bool(self.page_view(0).flags.c_contiguous)

    def _native_page(self, start: int) -> np.ndarray:
        p = self.geometry.page_size
        if start % p:
            raise ValueError(f"host index {start} is not at a page boundary (page size {p})")
        layout = self.geometry.layout
        if layout == "page_first_direct":
            return self._kv[:, start // p]
        if layout == "page_first":
            return self._kv[:, start:start + p]
        return self._kv[:, :, start:start + p]

    def page_view(self, start: int) -> np.ndarray:
        """The page starting at host index ``start`` as ``[layer, plane, token, head, word]`` (a view)."""
        return self._native_page(start).transpose(self._perm)

    def page_array(self, start: int) -> memoryview:
        """Writable flat bytes of a page, for ``direct`` pools only (the store copies to/from it)."""
        view = self.page_view(start)
        if not view.flags.c_contiguous:
            raise ValueError("page is not contiguous in this layout; stage it")
        return memoryview(view.reshape(-1).view(np.uint8))

    def _region(self, flat: np.ndarray, i: int) -> np.ndarray:
        """Page ``i`` of a flat uint8 buffer, shaped canonically in words."""
        return flat[i * self.page_bytes:(i + 1) * self.page_bytes].view(self._word).reshape(self._shape)

    def gather(self, starts: Sequence[int], dest: np.ndarray) -> None:
        """Copy pages into ``dest`` (flat uint8, ``len(starts) * page_bytes`` or more), canonical order."""
        for i, start in enumerate(starts):
            np.copyto(self._region(dest, i), self.page_view(start))

    def scatter(self, starts: Sequence[int], src: np.ndarray, which: Sequence[int] | None = None) -> None:
        """Write pages ``which`` (default: all) of canonical ``src`` into the host pool at ``starts``."""
        for i in range(len(starts)) if which is None else which:
            np.copyto(self.page_view(starts[i]), self._region(src, i))

    def gather_into(self, start: int, dest: Any) -> None:
        """Copy the page at host index ``start`` into ``dest``, one page of canonical bytes (a
        reserved slot's writable memoryview, or a flat uint8 array of ``page_bytes``): one
        ``np.copyto``, a plain memcpy for ``direct`` pools, one strided copy otherwise."""
        np.copyto(self._page_bytes(dest, "dest"), self.page_view(start))

    def scatter_from(self, start: int, src: Any) -> None:
        """Write one page of canonical bytes ``src`` (a leased slot's memoryview, read-only is
        fine, or a flat uint8 array of ``page_bytes``) into the host pool at ``start``: one copy."""
        np.copyto(self.page_view(start), self._page_bytes(src, "src"))

    def _page_bytes(self, buf: Any, what: str) -> np.ndarray:
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        if arr.dtype != np.uint8 or arr.ndim != 1 or arr.size != self.page_bytes:
            raise ValueError(f"{what}: expected {self.page_bytes} flat bytes (one page), got {arr.dtype} "
                             f"of shape {arr.shape}")
        return arr.view(self._word).reshape(self._shape)

    # -- SGLang's flat data pages (legacy get/set) --------------------------------------------------
    def flat_to_canonical(self, flat: torch.Tensor, dest: np.ndarray) -> None:
        """Copy a flat data page (native order, any dtype) into canonical bytes ``dest``."""
        np.copyto(self._region(dest, 0), self._flat_view(flat).transpose(self._perm))

    def canonical_to_flat(self, src: np.ndarray, flat: torch.Tensor) -> None:
        """Write canonical bytes ``src`` into a flat data page (native order)."""
        np.copyto(self._flat_view(flat).transpose(self._perm), self._region(src, 0))

    def _flat_view(self, flat: torch.Tensor) -> np.ndarray:
        if not flat.is_contiguous() or flat.device.type != "cpu":
            raise ValueError("a flat data page must be a contiguous host tensor")
        raw = flat.reshape(-1).view(torch.uint8).numpy()
        if raw.size != self.page_bytes:
            raise ValueError(f"flat page of {raw.size} bytes, expected {self.page_bytes}")
        return raw.view(self._word).reshape(self.native_page_shape)
