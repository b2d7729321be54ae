"""The worker's CUDA side: the streams its copies run on, and the store's host mapping registered
with CUDA so a copy between a store slot and the GPU is one DMA.

Made by :meth:`vllm_plugin.worker.WorkerSide.register_kv_caches` when vLLM's KV cache is on a GPU,
and handed to :meth:`~vllm_plugin.worker.WorkerSide.attach_device`; a CPU worker has none. Used from
the worker's forward thread only (the streams themselves are used by the save pipeline on that
thread and by the layer loader's thread). The copies were checked on an H100
(scripts/gpu_check_node.py, docs/VLLM.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mooncake_connector import cuda_host
from store_backend.api import KVStore
from store_backend.store import StoreClosedError

logger = logging.getLogger(__name__)


class DeviceCopies:
    """A worker's copies on a GPU: saves gather on ``side_stream`` (device-to-host), loads write on
    ``load_stream`` (host-to-device), and, with the slot pipelines, the store's whole host mapping
    is registered with CUDA once (pinned), so the slot copies are DMA from and to page-locked
    memory. Forward thread."""

    def __init__(self, side_stream: Any, load_stream: Any) -> None:
        self.side_stream = side_stream  # GPU: device-to-host gathers of saves
        self.load_stream = load_stream  # GPU: host-to-device copies and scatters of loads
        # The store's host mapping registered with CUDA (pinned), so slot copies are one DMA; the
        # slot path is used on a GPU only while slot views lie in that mapping.
        self.registration: cuda_host.HostRegistration | None = None
        self._view: memoryview | None = None
        self._warned = False

    @classmethod
    def open(cls, device: torch.device) -> DeviceCopies:
        """The two copy streams of a worker on ``device`` (a CUDA device)."""
        return cls(side_stream=torch.cuda.Stream(device=device), load_stream=torch.cuda.Stream(device=device))

    @property
    def registered(self) -> bool:
        """Whether the store's host mapping is registered now (not closed since)."""
        return self.registration is not None and self.registration.registered

    def register(self, store: KVStore) -> bool:
        """Register ``store``'s whole host mapping with CUDA once, so the slot path's copies are DMA
        from and to page-locked memory; False (warned once, the copies then go through staging)
        when the store exposes no ``host_mapping`` or the driver refused. Blocking (the driver
        locks every page)."""
        get_mapping = getattr(store, "host_mapping", None)
        view = get_mapping() if callable(get_mapping) else None
        if view is None:
            self.warn_staging("the store exposes no host mapping to register")
            return False
        reg = cuda_host.register_host(view)
        if not reg.registered:
            reg.close()
            self.warn_staging(f"its host mapping could not be registered with CUDA ({reg.reason})")
            return False
        self.registration, self._view = reg, view
        logger.info("tiered connector: %d bytes of store memory registered with CUDA in %.2f s; "
                    "slots are copied to and from the GPU directly", reg.nbytes, reg.elapsed_s)
        return True

    def warn_staging(self, why: str) -> None:
        """Say once that GPU copies go through pinned staging, and why."""
        if not self._warned:
            self._warned = True
            logger.warning("tiered connector: GPU copies go through pinned staging (a second copy): %s", why)

    def slot_views_usable(self, store: KVStore) -> bool:
        """Whether this step may copy between ``store``'s slots and the GPU directly: while the
        store's host mapping is the one registered (a node service that restarted with a new
        segment hands out slots outside it: the registration is closed, warned once, and this is
        False from then on)."""
        if self.registration is None or not self.registration.registered:
            return False
        try:
            current = store.host_mapping()
        except StoreClosedError:
            return False
        if current is not self._view:
            self.warn_staging("the store's host mapping changed since it was registered")
            self.registration.close()
            return False
        return True

    def close(self) -> None:
        """Unregister the host mapping; call it before the store (the mapping's owner) may unmap
        it."""
        if self.registration is not None:
            self.registration.close()
            self.registration = self._view = None
