"""The canonical byte layout of a KV chunk object, and conversion to and from an engine's paged KV.

A chunk object holds ``chunk_tokens`` tokens of one KV shard, all layers, **layer-major**: layer ``l``
is the contiguous byte range ``layer_range(l)``, so one layer can be read or written alone (the basis
of layer-wise loading). Inside a layer the bytes are ``[plane, token, head, dim]`` in the KV dtype,
C order, where the planes are K then V (one plane, the latent vector, for MLA). This layout does not
depend on the engine or its attention backend: the same tokens under the same fingerprint give the
same bytes whichever engine wrote them (the fingerprint's ``layout_version`` names this layout).

Engines keep KV in paged per-layer tensors whose block interiors differ by attention backend.
:class:`PagedLayer` wraps one layer's tensor as a ``[plane, block, token_in_block, head, dim]`` view
(no copy) and copies whole blocks between that view and a canonical layer region; the conversion
happens inside the one copy that moves the bytes anyway (gather on save, scatter on load).
``gather_into`` / ``scatter_from`` do that copy straight between the pages and a layer's byte range
of a store slot (a reserved or leased object), with no staging buffer and no temporary in between.

Who calls it: the engine connectors' worker side (vLLM's forward thread, SGLang's cache thread).
Not thread-safe per :class:`PagedLayer` instance; distinct layers may be used from distinct threads.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

# Same-size integer types, so numpy can move bytes of any KV dtype (bf16 and fp8 included).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PageFormat(str, enum.Enum):
    """How an engine's per-layer page ``[block, head, token, content]`` encodes K and V."""

    # Each (block, head) holds all of the block's K rows, then all its V rows (vLLM CPU_ATTN).
    KV_HALVES = "kv_halves"
    # Each token's content is K's head_size values followed by V's (FlashAttention-style backends).
    KV_INTERLEAVED = "kv_interleaved"
    # One latent vector per token and no separate V (MLA); head count 1.
    LATENT = "latent"


class ChunkLayout(msgspec.Struct, frozen=True):
    """Geometry of one canonical chunk object (pure arithmetic; no tensors)."""

    num_layers: int
    chunk_tokens: int
    num_heads: int  # KV heads of this shard (1 for MLA)
    head_size: int  # per-plane values per head (MLA: the latent size)
    element_bytes: int  # bytes per value of the KV dtype
    num_planes: int = 2  # K and V; 1 for MLA

    def __post_init__(self) -> None:
        for name in ("num_layers", "chunk_tokens", "num_heads", "head_size", "element_bytes", "num_planes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_planes not in (1, 2):
            raise ValueError(f"num_planes must be 1 or 2, got {self.num_planes}")

    @property
    def token_bytes_per_layer(self) -> int:
        return self.num_planes * self.num_heads * self.head_size * self.element_bytes

    @property
    def layer_bytes(self) -> int:
        return self.chunk_tokens * self.token_bytes_per_layer

    @property
    def chunk_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of ``layer`` inside a chunk object."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} not in [0, {self.num_layers})")
        start = layer * self.layer_bytes
        return start, start + self.layer_bytes

    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer region in values: ``(planes, tokens, heads, head_size)``."""
        return (self.num_planes, self.chunk_tokens, self.num_heads, self.head_size)


def canonical_layer(chunk: torch.Tensor, layout: ChunkLayout, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """View of ``layer`` inside a flat uint8 chunk tensor as ``[planes, tokens, heads, head_size]``."""
    start, end = layout.layer_range(layer)
    return chunk[start:end].view(dtype).view(layout.layer_shape())


class PagedLayer:
    """One layer of an engine's paged KV cache, seen as ``[plane, block, token, head, dim]``.

    ``kv`` is the layer's tensor with blocks on dim 0 (vLLM's per-layer ``[B, H, N, C]`` view, in
    the KV dtype). The wrapped view aliases ``kv``: ``scatter`` writes into the engine's memory.
    """

    def __init__(self, kv: torch.Tensor, page_format: PageFormat, *, num_heads: int, head_size: int) -> None:
        if kv.dim() != 4:
            raise ValueError(f"expected a [blocks, heads, tokens, content] tensor, got shape {tuple(kv.shape)}")
        blocks, heads, tokens, content = kv.shape
        if page_format is PageFormat.LATENT:
            if heads != 1 or content != head_size:
                raise ValueError(f"latent page needs [B, 1, N, {head_size}], got {tuple(kv.shape)}")
        elif heads != num_heads or content != 2 * head_size:
            raise ValueError(f"K/V page needs [B, {num_heads}, N, {2 * head_size}], got {tuple(kv.shape)}")
        elif page_format is PageFormat.KV_HALVES and (kv.stride(3) != 1 or kv.stride(2) != content):
            raise ValueError("kv_halves pages need each (block, head) interior contiguous")
        self.page_format = page_format
        self.head_size = head_size
        planes = self._planes(kv)
        self.kv = kv
        self.planes = planes  # [P, B, N, H, D]
        self.block_tokens = tokens
        self.num_blocks = blocks
        self.device = kv.device
        self.dtype = kv.dtype
        # On the CPU the copies run in numpy: single-threaded, so they never wait on the engine's
        # OpenMP threads (bound to cores that are busy with the forward).
        self._int = _INT_OF_SIZE[kv.element_size()]
        self._kv_np = kv.view(self._int).numpy() if kv.device.type == "cpu" else None
        # The whole layer as a strided numpy [P, B, N, H, D] view: a run of blocks is a slice of it.
        self._planes_all = self._planes_np(kv) if self._kv_np is not None else None

    def _planes(self, kv: torch.Tensor) -> torch.Tensor:
        """``[B, H, N, C]`` pages -> ``[P, B, N, H, D]`` view of the same memory."""
        blocks, heads, tokens, _ = kv.shape
        if self.page_format is PageFormat.LATENT:
            return kv.permute(0, 2, 1, 3).unsqueeze(0)
        if self.page_format is PageFormat.KV_HALVES:
            # The (token, content) interior of each (block, head) is read as [2, tokens, head_size].
            return kv.view(blocks, heads, 2, tokens, self.head_size).permute(2, 0, 3, 1, 4)
        return kv.unflatten(-1, (2, self.head_size)).permute(3, 0, 2, 1, 4)

    def _planes_np(self, pages: torch.Tensor) -> np.ndarray:
        """numpy twin of ``_planes`` over the CPU tensor ``pages`` (any strides; no copy)."""
        view = self._planes(pages)
        assert view.data_ptr() == pages.data_ptr()  # the strides below are relative to pages' first value
        base = pages.view(self._int).numpy()
        item = base.itemsize
        return np.lib.stride_tricks.as_strided(base, shape=tuple(view.shape),
                                               strides=tuple(st * item for st in view.stride()))

    def _runs(self, block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
        """``block_ids`` as runs of consecutive ids: ``(position, first id, length)`` each.

        Raises IndexError for an id outside ``[0, num_blocks)`` (a slice past the end would be
        shorter than its run and numpy would broadcast one block into several)."""
        runs: list[tuple[int, int, int]] = []
        start = 0
        n = len(block_ids)
        for i in range(n):
            b = int(block_ids[i])
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block id {b} (position {i}) not in [0, {self.num_blocks})")
            if i + 1 == n or int(block_ids[i + 1]) != b + 1:
                runs.append((start, int(block_ids[start]), i + 1 - start))
                start = i + 1
        return runs

    def _canonical_np(self, buf: Any, n: int, *, first_block: int, what: str) -> np.ndarray:
        """``buf`` (flat bytes: a numpy array or a buffer) as ``[P, blocks, N, H, D]`` in the
        same-size integer type; ValueError unless it holds whole blocks, ``first_block + n`` or more."""
        arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
        if arr.ndim != 1 or arr.dtype != np.uint8 or not arr.flags.c_contiguous:
            raise ValueError(f"{what} must be flat contiguous uint8 bytes, got {arr.dtype} of shape {arr.shape}")
        p, _, _, h, d = self.planes.shape
        block_bytes = p * self.block_tokens * h * d * self.kv.element_size()
        if arr.nbytes % block_bytes or arr.nbytes // block_bytes < first_block + n:
            raise ValueError(f"{what} of {arr.nbytes} bytes does not hold {first_block + n} whole blocks of "
                             f"{block_bytes} bytes")
        word = np.dtype(f"i{self.kv.element_size()}") if self.kv.element_size() > 1 else np.dtype(np.uint8)
        return arr.view(word).reshape(p, -1, self.block_tokens, h, d)

    def gather_into(self, block_ids: Sequence[int], dest: Any, *, non_blocking: bool = False,
                    stream: torch.cuda.Stream | None = None) -> None:
        """Copy blocks ``block_ids`` (in order) into ``dest``, the canonical byte range of one layer
        (``ChunkLayout.layer_range``: flat uint8, a numpy array or a writable buffer such as a
        reserved slot's memoryview), blocks ``0 .. len(block_ids) - 1`` of it.

        One copy and no temporary on the host: on the CPU one ``np.copyto`` per run of consecutive
        block ids straight from the engine's pages (strided) into ``dest``. On a GPU the blocks are
        selected and put in canonical order on the device (``stream``, else the current stream),
        then copied D2H into ``dest`` in one transfer (per plane when ``dest`` holds more blocks).
        With ``non_blocking`` the call returns once the copy is queued: ``dest`` is written when
        the stream gets there, and must stay alive (and be pinned for a real async DMA) until then.
        The caller orders ``stream`` after the kernels that wrote the blocks (``wait_stream`` or
        an event), and the engine's stream after ``scatter_from``'s stream before it reads them.
        Raises IndexError for a block id out of range, ValueError for a ``dest`` of the wrong size."""
        n = len(block_ids)
        region = self._canonical_np(dest, n, first_block=0, what="dest")
        if n == 0:
            return
        runs = self._runs(block_ids)
        if self._planes_all is not None:
            for pos, b0, length in runs:
                np.copyto(region[:, pos:pos + length], self._planes_all[:, b0:b0 + length])
            return
        with _on_stream(stream):
            pages = self.kv.index_select(0, self._ids(block_ids))
            staged = self._planes(pages).contiguous()  # [P, n, N, H, D] in canonical order, on the device
            host = _host_tensor(region)
            if host.shape[1] == n:
                host.view(self._int).copy_(staged.view(self._int), non_blocking=non_blocking)
            else:
                for plane in range(host.shape[0]):
                    host[plane, :n].view(self._int).copy_(staged[plane].view(self._int), non_blocking=non_blocking)

    def scatter_from(self, block_ids: Sequence[int], src: Any, *, first_block: int = 0,
                     non_blocking: bool = False, stream: torch.cuda.Stream | None = None,
                     scratch: torch.Tensor | None = None) -> None:
        """Write blocks ``first_block, first_block + 1, ...`` of ``src`` (one layer's canonical byte
        range, flat uint8: a numpy array or a buffer such as a leased slot's memoryview, read only
        is fine) into the engine's blocks ``block_ids`` in order.

        On the CPU one ``np.copyto`` per run of consecutive block ids straight from ``src`` into
        the pages, no temporary. On a GPU one H2D copy of the blocks' bytes into a device scratch
        (``scratch``: a uint8 device tensor of at least that many bytes, else one is allocated),
        then permute + ``index_copy_`` into the pages, all on ``stream`` (else the current stream).
        With ``non_blocking`` the call returns once queued; ``src`` must stay alive and unchanged
        until the stream has run the copy. Raises IndexError / ValueError as ``gather_into``."""
        n = len(block_ids)
        if first_block < 0:
            raise ValueError(f"first_block must be >= 0, got {first_block}")
        region = self._canonical_np(src, n, first_block=first_block, what="src")
        if n == 0:
            return
        runs = self._runs(block_ids)
        if self._planes_all is not None:
            for pos, b0, length in runs:
                at = first_block + pos
                np.copyto(self._planes_all[:, b0:b0 + length], region[:, at:at + length])
            return
        p, _, _, h, d = self.planes.shape
        with _on_stream(stream):
            host = _host_tensor(region)
            shape = (p, n, self.block_tokens, h, d)
            nbytes = p * n * self.block_tokens * h * d * self.kv.element_size()
            if scratch is None:
                dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            elif scratch.device != self.device or scratch.dtype != torch.uint8 or scratch.numel() < nbytes:
                raise ValueError(f"scratch must be a uint8 tensor of >= {nbytes} bytes on {self.device}, got "
                                 f"{scratch.dtype} of {scratch.numel()} on {scratch.device}")
            else:
                dev = scratch.view(-1)[:nbytes]
            staged = dev.view(self._int).view(shape)
            if first_block == 0 and host.shape[1] == n:
                staged.copy_(host.view(self._int), non_blocking=non_blocking)
            else:
                for plane in range(p):
                    staged[plane].copy_(host[plane, first_block:first_block + n].view(self._int),
                                        non_blocking=non_blocking)
            pages = torch.empty((n, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.device)
            self._planes(pages).copy_(staged.view(self.dtype))
            self.kv.index_copy_(0, self._ids(block_ids), pages)

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], dest: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy blocks ``block_ids`` (in order) into ``dest``, a canonical region ``[P, T, H, D]``
        with ``T == len(block_ids) * block_tokens``. ``dest`` may live on another device (host
        staging for a GPU cache): the copy is then issued ``non_blocking`` on the current stream."""
        n = len(block_ids)
        p, _, _, h, d = self.planes.shape
        out = dest.view(p, n, self.block_tokens, h, d)
        # Whole pages are gathered first (dim 0 of the engine tensor: fast row copies); the
        # transposition into the canonical order then runs over the small gathered copy only.
        if self._kv_np is not None and dest.device.type == "cpu":
            pages = torch.from_numpy(self._kv_np[np.asarray(block_ids, dtype=np.int64)])
            np.copyto(out.view(self._int).numpy(), self._planes_np(pages))
            return
        pages = self.kv.index_select(0, self._ids(block_ids))
        out.copy_(self._planes(pages), non_blocking=non_blocking)

    def scatter(self, block_ids: Sequence[int], src: torch.Tensor, *, first_block: int = 0,
                non_blocking: bool = False) -> None:
        """Write canonical region ``src`` (``[P, T, H, D]``) into blocks ``block_ids``.

        ``src`` holds ``first_block + len(block_ids)`` blocks' worth of tokens or more; blocks
        ``first_block, first_block + 1, ...`` of it go to ``block_ids`` in order (a chunk whose
        leading blocks the engine already holds is written from the middle)."""
        n = len(block_ids)
        if n == 0:
            return
        p, _, _, h, d = self.planes.shape
        region = src.view(p, -1, self.block_tokens, h, d)[:, first_block:first_block + n]
        if self._kv_np is not None and src.device.type == "cpu":
            pages_np = np.empty((n, *self.kv.shape[1:]), dtype=self._kv_np.dtype)
            np.copyto(self._planes_np(torch.from_numpy(pages_np)), region.view(self._int).numpy())
            self._kv_np[np.asarray(block_ids, dtype=np.int64)] = pages_np
            return
        pages = torch.empty((n, *self.kv.shape[1:]), dtype=self.kv.dtype, device=self.device)
        self._planes(pages).copy_(region, non_blocking=non_blocking)
        self.kv.index_copy_(0, self._ids(block_ids), pages)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _host_tensor(region: np.ndarray) -> torch.Tensor:
    """A torch view of a host numpy region (no copy); read-only sources are fine (only read)."""
    with warnings.catch_warnings():
        # torch warns that writes to a non-writable array are undefined; a source is only read.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(region)


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """Engine blocks split into ``ratio`` kernel blocks each: manager block ``b`` is kernel blocks
    ``b * ratio .. b * ratio + ratio - 1``."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + r for b in block_ids for r in range(ratio)]
