"""Canonical chunk layout: geometry, and lossless conversion to and from each paged format."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mooncake_connector.layout import (  # noqa: E402
    ChunkLayout,
    PagedLayer,
    PageFormat,
    canonical_layer,
    kernel_block_ids,
)

H, D, N = 2, 8, 4  # kv heads, head size, tokens per block


def test_layer_ranges_are_contiguous_and_layer_major() -> None:
    lay = ChunkLayout(num_layers=3, chunk_tokens=8, num_heads=H, head_size=D, element_bytes=2)
    assert lay.layer_bytes == 2 * 8 * H * D * 2
    assert lay.chunk_bytes == 3 * lay.layer_bytes
    assert [lay.layer_range(i) for i in range(3)] == [(0, lay.layer_bytes), (lay.layer_bytes, 2 * lay.layer_bytes),
                                                      (2 * lay.layer_bytes, 3 * lay.layer_bytes)]
    with pytest.raises(IndexError):
        lay.layer_range(3)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkLayout(num_layers=1, chunk_tokens=0, num_heads=1, head_size=1, element_bytes=1)


def _kv(fmt: PageFormat, blocks: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """An engine tensor of ``fmt`` and the K/V values it holds as [2, blocks, N, H, D]."""
    kv_vals = torch.randn(2, blocks, N, H, D).to(dtype)
    if fmt is PageFormat.KV_HALVES:  # per (block, head): N rows of K then N rows of V
        t = kv_vals.permute(1, 3, 0, 2, 4).reshape(blocks, H, 2 * N, D).reshape(blocks, H, N, 2 * D)
    else:  # per token: K values then V values; stored token-major (NHD) and viewed as [B, H, N, C]
        phys = torch.cat([kv_vals[0], kv_vals[1]], dim=-1)  # [B, N, H, 2D]
        t = phys.permute(0, 2, 1, 3)
    return t, kv_vals


@pytest.mark.parametrize("fmt", [PageFormat.KV_HALVES, PageFormat.KV_INTERLEAVED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_produces_canonical_bytes_and_scatter_inverts_it(fmt: PageFormat, dtype: torch.dtype) -> None:
    kv, vals = _kv(fmt, 6, dtype)
    paged = PagedLayer(kv, fmt, num_heads=H, head_size=D)
    lay = ChunkLayout(num_layers=2, chunk_tokens=2 * N, num_heads=H, head_size=D,
                      element_bytes=torch.empty((), dtype=dtype).element_size())
    chunk = torch.zeros(lay.chunk_bytes, dtype=torch.uint8)
    region = canonical_layer(chunk, lay, 1, dtype)
    paged.gather([4, 1], region)
    want = torch.cat([vals[:, 4], vals[:, 1]], dim=1)  # [2, 2N, H, D]: K plane, V plane, token-major
    assert torch.equal(region, want)
    assert chunk[:lay.layer_bytes].count_nonzero() == 0  # layer 0's range untouched

    fresh = torch.zeros_like(kv) if fmt is PageFormat.KV_HALVES else torch.zeros(6, N, H, 2 * D, dtype=dtype)
    target = PagedLayer(fresh if fmt is PageFormat.KV_HALVES else fresh.permute(0, 2, 1, 3), fmt,
                        num_heads=H, head_size=D)
    target.scatter([0, 5], region)
    assert torch.equal(target.planes[:, 0], vals[:, 4]) and torch.equal(target.planes[:, 5], vals[:, 1])
    assert target.planes[:, 1:5].count_nonzero() == 0


def test_scatter_from_the_middle_of_a_chunk_writes_only_the_tail_blocks() -> None:
    kv, vals = _kv(PageFormat.KV_HALVES, 4)
    paged = PagedLayer(kv, PageFormat.KV_HALVES, num_heads=H, head_size=D)
    lay = ChunkLayout(num_layers=1, chunk_tokens=3 * N, num_heads=H, head_size=D, element_bytes=4)
    chunk = torch.empty(lay.chunk_bytes, dtype=torch.uint8)
    paged.gather([0, 1, 2], canonical_layer(chunk, lay, 0, torch.float32))
    out = PagedLayer(torch.zeros_like(kv), PageFormat.KV_HALVES, num_heads=H, head_size=D)
    out.scatter([3], canonical_layer(chunk, lay, 0, torch.float32), first_block=2)
    assert torch.equal(out.planes[:, 3], vals[:, 2])
    assert out.planes[:, :3].count_nonzero() == 0


def test_latent_pages_round_trip() -> None:
    latent = torch.randn(5, 1, N, 12)
    paged = PagedLayer(latent, PageFormat.LATENT, num_heads=1, head_size=12)
    lay = ChunkLayout(num_layers=1, chunk_tokens=N, num_heads=1, head_size=12, element_bytes=4, num_planes=1)
    chunk = torch.empty(lay.chunk_bytes, dtype=torch.uint8)
    region = canonical_layer(chunk, lay, 0, torch.float32)
    paged.gather([3], region)
    assert torch.equal(region[0, :, 0], latent[3, 0])
    out = PagedLayer(torch.zeros_like(latent), PageFormat.LATENT, num_heads=1, head_size=12)
    out.scatter([1], region)
    assert torch.equal(out.kv[1], latent[3])


def test_wrong_geometry_is_refused() -> None:
    with pytest.raises(ValueError, match="K/V page"):
        PagedLayer(torch.zeros(2, H, N, 3 * D), PageFormat.KV_INTERLEAVED, num_heads=H, head_size=D)
    with pytest.raises(ValueError, match="contiguous"):
        PagedLayer(torch.zeros(2, N, H, 2 * D).permute(0, 2, 1, 3), PageFormat.KV_HALVES, num_heads=H, head_size=D)


def test_kernel_block_ids_split_engine_blocks() -> None:
    assert kernel_block_ids([3, 7], 1) == [3, 7]
    assert kernel_block_ids([3, 7], 2) == [6, 7, 14, 15]


# -- gather_into / scatter_from: one copy between the engine's pages and a layer's canonical range ----

import tracemalloc  # noqa: E402

import numpy as np  # noqa: E402

_FORMATS = [PageFormat.KV_HALVES, PageFormat.KV_INTERLEAVED, PageFormat.LATENT]


def _paged(fmt: PageFormat, blocks: int, dtype: torch.dtype, *, n: int = N, h: int = H,
           d: int = D) -> PagedLayer:
    """A PagedLayer over random pages of ``fmt``, laid out as the engines lay them out."""
    def values(*shape: int) -> torch.Tensor:  # uint8 stands for a 1-byte (fp8) cache
        return torch.randn(*shape).to(dtype) if dtype.is_floating_point else torch.randint(0, 256, shape, dtype=dtype)
    if fmt is PageFormat.LATENT:
        return PagedLayer(values(blocks, 1, n, d), fmt, num_heads=1, head_size=d)
    if fmt is PageFormat.KV_HALVES:
        return PagedLayer(values(blocks, h, n, 2 * d), fmt, num_heads=h, head_size=d)
    # NHD storage viewed as [B, H, N, C]: a non-contiguous engine tensor
    return PagedLayer(values(blocks, n, h, 2 * d).permute(0, 2, 1, 3), fmt, num_heads=h, head_size=d)


def _layout_of(paged: PagedLayer, blocks_per_chunk: int, layers: int = 3) -> ChunkLayout:
    p, _, n, h, d = paged.planes.shape
    return ChunkLayout(num_layers=layers, chunk_tokens=blocks_per_chunk * n, num_heads=h, head_size=d,
                       element_bytes=paged.kv.element_size(), num_planes=p)


def _device_path(paged: PagedLayer) -> PagedLayer:
    """The same layer taking the torch (GPU) code path on CPU tensors: index_select, permute, one
    copy_. Checks that path's arithmetic where no GPU is present."""
    paged._planes_all = None
    return paged


_ID_CASES = [[0, 1, 2, 3], [5, 2, 3, 7], [7, 6, 5, 4], [1, 3, 5, 0], [4, 5, 0, 1]]


@pytest.mark.parametrize("fmt", _FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("ids", _ID_CASES)
@pytest.mark.parametrize("device_path", [False, True])
def test_gather_into_writes_the_bytes_gather_writes(fmt: PageFormat, dtype: torch.dtype, ids: list[int],
                                                    device_path: bool) -> None:
    paged = _paged(fmt, 8, dtype)
    lay = _layout_of(paged, len(ids))
    want = torch.zeros(lay.chunk_bytes, dtype=torch.uint8)
    paged.gather(ids, canonical_layer(want, lay, 1, paged.dtype))
    chunk = np.zeros(lay.chunk_bytes, dtype=np.uint8)
    start, end = lay.layer_range(1)
    target = _device_path(paged) if device_path else paged
    target.gather_into(ids, memoryview(chunk)[start:end])  # a slot's layer as a memoryview
    assert chunk.tobytes() == want.numpy().tobytes()
    assert not chunk[:start].any() and not chunk[end:].any()
    got = np.zeros(end - start, dtype=np.uint8)
    target.gather_into(ids, got)  # and as a numpy array
    assert got.tobytes() == want.numpy()[start:end].tobytes()


@pytest.mark.parametrize("fmt", _FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", _ID_CASES)
@pytest.mark.parametrize("first_block", [0, 1, 3])
@pytest.mark.parametrize("device_path", [False, True])
def test_scatter_from_writes_the_pages_scatter_writes(fmt: PageFormat, dtype: torch.dtype, ids: list[int],
                                                      first_block: int, device_path: bool) -> None:
    source = _paged(fmt, 8, dtype)
    lay = _layout_of(source, 6)
    chunk = torch.zeros(lay.chunk_bytes, dtype=torch.uint8)
    source.gather([6, 0, 2, 3, 7, 1], canonical_layer(chunk, lay, 2, dtype))
    todo = ids[:6 - first_block]
    old = _paged(fmt, 8, dtype)
    new = PagedLayer(old.kv.clone(), fmt, num_heads=old.planes.shape[3], head_size=old.head_size)
    old.scatter(todo, canonical_layer(chunk, lay, 2, dtype), first_block=first_block)
    start, end = lay.layer_range(2)
    src = bytes(chunk.numpy()[start:end])  # read-only, as a leased slot may be
    (_device_path(new) if device_path else new).scatter_from(todo, src, first_block=first_block)
    assert torch.equal(new.kv.view(torch.uint8), old.kv.view(torch.uint8))


@pytest.mark.parametrize("fmt", _FORMATS)
def test_kernel_block_ratio_two_round_trips(fmt: PageFormat) -> None:
    paged = _paged(fmt, 12, torch.bfloat16)
    engine_blocks = [4, 1, 2]
    kernel = kernel_block_ids(engine_blocks, 2)  # [8, 9, 2, 3, 4, 5]: runs of two and four
    lay = _layout_of(paged, len(kernel))
    want = torch.zeros(lay.layer_bytes, dtype=torch.uint8)
    paged.gather(kernel, want.view(paged.dtype).view(lay.layer_shape()))
    got = np.empty(lay.layer_bytes, dtype=np.uint8)
    paged.gather_into(kernel, got)
    assert got.tobytes() == want.numpy().tobytes()
    out = PagedLayer(torch.zeros_like(paged.kv), fmt, num_heads=paged.planes.shape[3], head_size=paged.head_size)
    out.scatter_from(kernel, got)
    for b in kernel:
        assert torch.equal(out.planes[:, b], paged.planes[:, b])
    others = [b for b in range(12) if b not in kernel]
    assert out.planes[:, others].count_nonzero() == 0


@pytest.mark.parametrize("fmt", _FORMATS)
def test_one_copy_allocates_no_chunk_sized_temporary_on_the_cpu(fmt: PageFormat) -> None:
    # 16 blocks of 16 tokens, 8 heads of 64 fp32 values: 1 MiB per plane-pair layer (512 KiB MLA).
    paged = _paged(fmt, 32, torch.float32, n=16, h=8, d=64)
    ids = [3, 4, 5, 9, 10, 20, 21, 22, 23, 0, 1, 2, 30, 31, 6, 7]
    lay = _layout_of(paged, len(ids), layers=1)
    buf = np.empty(lay.layer_bytes, dtype=np.uint8)
    out = PagedLayer(torch.zeros_like(paged.kv), fmt, num_heads=paged.planes.shape[3], head_size=paged.head_size)
    paged.gather_into(ids, buf)  # warm up (lazy imports, caches)
    out.scatter_from(ids, buf)
    for name, call in (("gather_into", lambda: paged.gather_into(ids, buf)),
                       ("scatter_from", lambda: out.scatter_from(ids, buf))):
        tracemalloc.start()
        try:
            call()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < lay.layer_bytes // 16, f"{name} allocated {peak} bytes for a {lay.layer_bytes}-byte layer"
    for b in ids:
        assert torch.equal(out.planes[:, b], paged.planes[:, b])


def test_gather_into_and_scatter_from_refuse_bad_ids_and_sizes() -> None:
    paged = _paged(PageFormat.KV_HALVES, 4, torch.float32)
    lay = _layout_of(paged, 2)
    buf = np.zeros(lay.layer_bytes, dtype=np.uint8)
    with pytest.raises(IndexError, match="block id 4"):
        paged.gather_into([3, 4], buf)
    with pytest.raises(IndexError, match="block id -1"):
        paged.scatter_from([-1, 0], buf)
    with pytest.raises(ValueError, match="does not hold 3 whole blocks"):
        paged.gather_into([0, 1, 2], buf)
    with pytest.raises(ValueError, match="does not hold 3 whole blocks"):
        paged.scatter_from([0, 1], buf, first_block=1)
    with pytest.raises(ValueError, match="whole blocks"):
        paged.gather_into([0], buf[:-1])
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        paged.gather_into([0], buf.view(np.float32))
    paged.gather_into([], buf[:0])  # nothing to copy is fine


def test_device_path_scatter_uses_a_callers_scratch_and_refuses_a_small_one() -> None:
    source = _paged(PageFormat.KV_HALVES, 6, torch.bfloat16)
    lay = _layout_of(source, 3)
    buf = np.empty(lay.layer_bytes, dtype=np.uint8)
    source.gather_into([5, 0, 1], buf)
    out = _device_path(PagedLayer(torch.zeros_like(source.kv), PageFormat.KV_HALVES, num_heads=H, head_size=D))
    scratch = torch.full((lay.layer_bytes + 64,), 0xAB, dtype=torch.uint8)
    out.scatter_from([2, 3], buf, first_block=1, scratch=scratch)
    assert torch.equal(out.planes[:, 2:4], source.planes[:, [0, 1]])
    assert (scratch[:2 * lay.layer_bytes // 3] != 0xAB).any()  # the copy went through the scratch
    with pytest.raises(ValueError, match="scratch must be a uint8 tensor"):
        out.scatter_from([2, 3], buf, scratch=scratch[:100])
