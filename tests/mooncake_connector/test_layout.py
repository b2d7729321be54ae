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
