"""Real SGLang HiCache machinery on CPU, driven the way SGLang's radix cache drives it.

Everything here is SGLang's own code (device pools, host pools, ``HiCacheController`` with its
backup and prefetch threads, ``StorageBackendFactory``, its page hash); the only stand-in is
:class:`Scheduler`, which plays the scheduler thread's part of the protocol: it hands backups to the
controller and, for a prefetch, allocates host slots for the storage hit and collects the acks
(``unified_radix_cache.py``: ``_drain_and_alloc_storage_hit`` / ``_drain_ack_prefetch``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 16
KV_LORA_RANK, ROPE_DIM = 24, 8
DEVICE_TOKENS = 256
ACK_TIMEOUT_S = 30.0


def extra_config(store: dict[str, Any], **more: Any) -> dict[str, Any]:
    """The extra config of docs/SGLANG.md: SGLang's dynamic-loader keys plus connector keys."""
    return {"backend_name": "mooncake_tiered", "module_path": "sglang_hicache.storage",
            "class_name": "MooncakeTieredStorage", "interface_v1": 1, "store": store, **more}


@dataclass
class Pools:
    device: Any
    allocator: PagedTokenToKVPoolAllocator
    host: Any
    is_mla: bool


def make_pools(layout: str, *, mla: bool = False, dtype: torch.dtype = torch.bfloat16,
               page_size: int = PAGE, layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM,
               host_ratio: float = 2.0) -> Pools:
    """A CPU device KV pool, its allocator and a host pool of ``layout`` built from it, as SGLang does."""
    if mla:
        device = MLATokenToKVPool(size=DEVICE_TOKENS, page_size=page_size, dtype=dtype, kv_lora_rank=KV_LORA_RANK,
                                  qk_rope_head_dim=ROPE_DIM, layer_num=layers, device="cpu",
                                  enable_memory_saver=False)
        info = device.get_device_pool_infos()[0].buffer_info
        host = MLATokenToKVPoolHost(info, host_ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers - 1,
                                    target_layer_num=layers)
    else:
        device = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=page_size, dtype=dtype, head_num=heads,
                                  head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
                                  enable_alt_stream=False)
        info = device.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(info, host_ratio, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=layers - 1)
    allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, page_size, dtype, "cpu", device, need_sort=False)
    return Pools(device=device, allocator=allocator, host=host, is_mla=mla)


def fill_pages(host: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Random page contents written with SGLang's own ``set_from_flat_data_page`` (as a D2H copy would)."""
    gen = torch.Generator().manual_seed(seed)
    page = host.page_size
    for start in host_indices[::page].tolist():
        flat = host.get_dummy_flat_data_page()
        raw = flat.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        host.set_from_flat_data_page(start, flat)


def read_pages(host: Any, host_indices: torch.Tensor) -> list[torch.Tensor]:
    """Each page's bytes, read with SGLang's own ``get_data_page``."""
    page = host.page_size
    return [host.get_data_page(s, flat=True).view(torch.uint8).clone() for s in host_indices[::page].tolist()]


def token_kv(host: Any, layer: int, token: int, plane: int) -> torch.Tensor:
    """One token's K (plane 0), V (plane 1) or MLA latent (plane 0) in the host pool, indexed by
    the dimensions SGLang's ``init_kv_buffer`` gives each layout."""
    kv, p = host.kv_buffer, host.page_size
    if not hasattr(host, "kv_cache_dim"):  # MHA: a leading K/V axis
        kv = kv[plane]
    if host.layout == "layer_first":
        return kv[layer, token]
    if host.layout == "page_first":
        return kv[token, layer]
    assert host.layout == "page_first_direct"
    return kv[token // p, layer, token % p]


class Scheduler:
    """A real HiCacheController with a storage backend; the scheduler thread's part played here."""

    def __init__(self, pools: Pools, extra: dict[str, Any], *, backend: str = "dynamic",
                 model_name: str = "tiny-llama") -> None:
        self.pools = pools
        self.host = pools.host
        self.page = pools.host.page_size
        self.controller = HiCacheController(
            pools.allocator, pools.host, self.page, tp_group=None, load_cache_event=threading.Event(),
            io_backend="direct", storage_backend=backend, model_name=model_name,
            storage_backend_extra_config=dict(extra))
        self.backend = self.controller.storage_backend

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        return get_storage_hash_str(list(tokens), None, page_size=self.page)

    def backup(self, tokens: Sequence[int], seed: int = 0) -> tuple[torch.Tensor, int]:
        """Fill host pages for ``tokens`` and back them up through the backup thread.
        Returns the host indices and the tokens the controller reports written."""
        host_indices = self.host.alloc(len(tokens))
        assert host_indices is not None, "host pool full"
        fill_pages(self.host, host_indices, seed)
        op_id = self.controller.write_storage(host_indices, list(tokens), hash_value=self.hashes(tokens))
        op = self.controller.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        assert op.id == op_id
        return host_indices, op.completed_tokens

    def prefetch(self, tokens: Sequence[int], rid: str = "req",
                 before_transfer: Any = None) -> tuple[int, int, torch.Tensor | None]:
        """Prefetch ``tokens`` through the prefetch threads.

        Returns (tokens the storage hit query found, tokens loaded, host indices holding them).
        ``before_transfer`` runs between the hit query and the transfer (fault injection)."""
        c = self.controller
        c.prefetch(rid, list(tokens))
        op = c.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        hit = op.storage_hit_count
        if hit == 0:
            return 0, 0, None
        host_indices = c.alloc_prefetch_host_buffers(op, hit)
        assert host_indices is not None, "host pool full"
        op.host_indices = host_indices
        if before_transfer is not None:
            before_transfer()
        c.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = c.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
            assert ack.operation is op
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.completed_req:
                break
        return hit, completed, host_indices

    def lookup_only(self, tokens: Sequence[int], rid: str = "req") -> int:
        """Run the hit query for ``tokens`` and drop the prefetch, as SGLang's scheduler does for a hit
        below ``prefetch_threshold``, a smaller rank-agreed hit or a terminated request: the backend's
        ``batch_exists`` runs and no ``batch_get_v1`` follows. Returns the tokens the query found."""
        c = self.controller
        c.prefetch(rid, list(tokens))
        return c.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S).storage_hit_count

    def threads_alive(self) -> bool:
        c = self.controller
        return all(t.is_alive() for t in (c.prefetch_thread, c.prefetch_io_aux_thread, c.prefetch_sync_thread,
                                          c.backup_thread))

    def close(self) -> None:
        self.controller.detach_storage_backend()
