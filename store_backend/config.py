"""Typed configuration of the store: the Structs, and :func:`load_config` that reads them.

A config comes from a JSON or YAML file, a dict, or ``MOONCAKE_KV_*`` environment variables
(``MOONCAKE_KV_CONFIG`` names a file; ``MOONCAKE_KV_DRAM__CAPACITY_BYTES=4GiB`` sets a nested field,
``__`` separating the levels). Every field whose name ends in ``_bytes`` also accepts a size string
such as ``"512MiB"`` or ``"4GB"``. Reading, sizes and error messages live in
:mod:`store_backend.config_loader`, shared with the connectors' configs. A bad value raises
:class:`ConfigError` naming the field's full path; a closed choice (eviction and admission policy,
SSD backend, I/O engine, offload policy) is checked when the config is read, against the names
registered at that moment.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from store_backend.config_loader import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    ConfigError,
    GiB,
    KiB,
    MiB,
    check_variables,
    decode,
    env_overrides,
    merge,
    one_of,
    parse_size,
    read_file,
    variable_name,
)
from store_backend.policies.admission import admission_names
from store_backend.policies.registry import policy_names

__all__ = [
    "CONFIG_FILE_ENV", "ENV_PREFIX", "ConfigError", "DramConfig", "GiB", "KiB", "MiB", "OffloadConfig",
    "PromotionConfig", "SsdConfig", "StoreConfig", "config_from_dict", "load_config", "parse_size",
]


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")


# Larger sizes are typos (or overflow a file offset): nothing this store maps or writes is that big.
MAX_BYTES = 1 << 60
# The smallest SSD tier that can hold one object: a record's header block and one value block,
# plus a bucket's footer block or the offset file's superblock, in 4 KiB blocks.
MIN_SSD_CAPACITY_BYTES = 4 * 4096


def _size(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name}: must be at least {minimum}, got {value}")
    if value > MAX_BYTES:
        raise ValueError(f"{name}: must be at most {MAX_BYTES} (1 EiB), got {value}")


def _fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: must be in (0, 1], got {value}")


def _power_of_two(name: str, value: int) -> None:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name}: must be a power of two, got {value}")


class DramConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Host-DRAM tier: one page-aligned arena carved by an offset allocator."""

    # Size of the arena; objects beyond it are evicted (or moved to SSD first) by eviction_policy.
    capacity_bytes: int = 1 * GiB
    # Name of a /dev/shm segment holding the arena, so processes of one node can map it; None = private.
    shm_name: str | None = None
    # Every allocation starts at a multiple of this (4096 lets SSD writes use O_DIRECT from the arena).
    alignment_bytes: int = 4096
    # Which object leaves DRAM first (store_backend/policies/registry.py): "prefix_reuse" (leaves of
    # the prefix tree first, objects requested more than once kept longer), "prefix_lru", "lru", "fifo".
    eviction_policy: str = "prefix_reuse"

    def __post_init__(self) -> None:
        _power_of_two("alignment_bytes", self.alignment_bytes)
        # Below one alignment unit nothing fits: every put would answer TOO_LARGE.
        _size("capacity_bytes", self.capacity_bytes, minimum=max(1, self.alignment_bytes))
        if self.shm_name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", self.shm_name):
            raise ValueError(f"shm_name: must be 1-200 of [A-Za-z0-9_.-], got {self.shm_name!r}")
        one_of("eviction_policy", self.eviction_policy, policy_names())


class SsdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """SSD tier: one directory, one backend."""

    # The tier's directory, owned by one store (a second opener is refused naming the holder).
    path: str
    # Most bytes the tier keeps; past it (or past disk_watermark) the oldest objects are evicted.
    capacity_bytes: int = 64 * GiB
    # How objects are laid out: "bucket" (objects batched into large append-only files; fastest
    # writes), "offset" (one preallocated file, records at allocator offsets), "file" (one file per
    # object; the only one several processes can share, see the connectors' shared_ssd).
    backend: Literal["bucket", "offset", "file"] = "bucket"
    # "io_uring" (raw syscalls, no library needed), "posix" (thread pool of preadv/pwritev), or
    # "auto": io_uring where the kernel allows it, else posix.
    io_engine: Literal["auto", "io_uring", "posix"] = "auto"
    # Read and write with O_DIRECT (4 KiB-aligned, bypassing the page cache) where the file system
    # supports it; falls back to buffered I/O where it does not.
    direct_io: bool = True
    # Threads of the posix engine (io_uring uses one ring per calling thread instead).
    io_threads: int = 2
    # Requests in flight per io_uring ring.
    queue_depth: int = 32
    # bucket backend: a bucket file is written once when it reaches either threshold.
    bucket_size_bytes: int = 64 * MiB
    # bucket backend: most objects in one bucket file (the other threshold).
    bucket_max_keys: int = 256
    # Which objects an SSD backend evicts first when it needs room: "lru" (least recently read) or
    # "fifo" (oldest written).
    bucket_eviction: Literal["fifo", "lru"] = "lru"
    # Evict when used space (or the file system's use) passes this fraction of capacity.
    disk_watermark: float = 0.95
    # Which DRAM objects are worth an SSD write (store_backend/policies/admission.py): "prefix" skips
    # objects whose prefix is stored nowhere (they can never be hit), "reused" also skips objects
    # not requested twice by the time they leave DRAM, "all" writes everything. A declined object is
    # asked again when DRAM is about to evict it.
    admission_policy: str = "prefix"

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path: must not be empty")
        if self.path != self.path.strip():
            # Kept as written, never stripped: "/mnt/kv " is another directory than "/mnt/kv".
            raise ValueError(f"path: starts or ends with white space: {self.path!r}")
        _size("capacity_bytes", self.capacity_bytes, minimum=MIN_SSD_CAPACITY_BYTES)
        _positive("io_threads", self.io_threads)
        _positive("queue_depth", self.queue_depth)
        _size("bucket_size_bytes", self.bucket_size_bytes)
        _positive("bucket_max_keys", self.bucket_max_keys)
        _fraction("disk_watermark", self.disk_watermark)
        one_of("admission_policy", self.admission_policy, admission_names())


# offload.put_wait_s: chosen from the write-burst benchmark (docs/PERFORMANCE.md, "Write bursts").
PUT_WAIT_S_DEFAULT = 1.0
# offload.write_threads: chosen from the offload-vs-fio benchmark (docs/PERFORMANCE.md, "Write bursts").
WRITE_THREADS_DEFAULT = 4
MAX_PUT_WAIT_S = 3600.0


class OffloadConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When objects move from DRAM to SSD (never on the put path)."""

    # eager: every new object is copied to SSD soon after it is written (DRAM keeps a clean copy).
    # watermark: only when DRAM use passes high_watermark, coldest objects move down to low_watermark.
    policy: Literal["eager", "watermark"] = "eager"
    # watermark policy: fraction of DRAM in use that starts a demotion pass.
    high_watermark: float = 0.9
    # watermark policy: fraction of DRAM in use a demotion pass goes down to.
    low_watermark: float = 0.7
    # Objects waiting for their SSD write; past it a new object waits in DRAM until DRAM needs room
    # (then it is written before it is evicted).
    queue_max_objects: int = 65536
    # Most bytes handed to the SSD backend in one write batch.
    batch_bytes: int = 64 * MiB
    # SSD write batches in flight at once (offload threads), so that one batch's checksums, file
    # creation and sync overlap the next one's write. All of them together lease at most half of
    # DRAM (each batch at most its share of that half).
    write_threads: int = WRITE_THREADS_DEFAULT
    # With an SSD tier, an object put in DRAM is never dropped before its SSD copy exists. When
    # DRAM is full of objects not yet written down, a put waits up to this many seconds (blocking
    # its caller, a connector's I/O thread) for the offload to make room, then is refused
    # (NO_SPACE: a save not stored). 0: refused at once. Slot reserves wait only when asked. A wait
    # seldom lasts past one batch write (10-30 ms here), so the default keeps every put of bursts
    # at 1-4 times the SSD's rate; it bounds the stall of an SSD that hangs (docs/PERFORMANCE.md).
    put_wait_s: float = PUT_WAIT_S_DEFAULT

    def __post_init__(self) -> None:
        if not 0.0 <= self.put_wait_s <= MAX_PUT_WAIT_S:
            raise ValueError(f"put_wait_s: must be in [0, {MAX_PUT_WAIT_S:g}] seconds, got {self.put_wait_s}")
        _fraction("high_watermark", self.high_watermark)
        _fraction("low_watermark", self.low_watermark)
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark: {self.low_watermark} must be below high_watermark ({self.high_watermark})"
            )
        _positive("queue_max_objects", self.queue_max_objects)
        _size("batch_bytes", self.batch_bytes)
        if not 1 <= self.write_threads <= 16:
            raise ValueError(f"write_threads: must be in [1, 16], got {self.write_threads}")


class PromotionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When an object read from SSD is copied back into DRAM (in the background)."""

    # Copy objects read from SSD back into DRAM (off the read path).
    enabled: bool = True
    admission_hits: int = 2  # SSD hits before a promotion
    # Promotions waiting; past it further ones are skipped (the object stays on SSD).
    queue_max_objects: int = 4096

    def __post_init__(self) -> None:
        _positive("admission_hits", self.admission_hits)
        _positive("queue_max_objects", self.queue_max_objects)


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The whole store: a DRAM tier, optionally an SSD tier below it, and how objects move."""

    # The host-DRAM tier (section `dram`).
    dram: DramConfig = msgspec.field(default_factory=DramConfig)
    # The SSD tier (section `ssd`); absent: DRAM only.
    ssd: SsdConfig | None = None
    # When objects are written down to SSD (section `offload`).
    offload: OffloadConfig = msgspec.field(default_factory=OffloadConfig)
    # When SSD objects come back to DRAM (section `promotion`).
    promotion: PromotionConfig = msgspec.field(default_factory=PromotionConfig)
    # Largest object a put accepts (larger: TOO_LARGE).
    max_object_bytes: int = 256 * MiB

    def __post_init__(self) -> None:
        _size("max_object_bytes", self.max_object_bytes)


def config_from_dict(data: Mapping[str, Any], cls: type = StoreConfig) -> Any:
    """Build and validate a config Struct from plain data, no environment (raises ConfigError)."""
    return decode(data, cls)


def _store_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A store config file; a whole connector config file gives its ``store`` section (the rest of
    it is the connector's, read by its own loader). A file with no store field and no ``store``
    section (a connector config without one) is refused rather than read as the default store."""
    data = read_file(path)
    for key in data:
        if not isinstance(key, str):  # YAML reads `yes:` as True
            raise ConfigError(f"key {key!r} is not a field name (from config file {path})")
    fields = set(StoreConfig.__struct_fields__)
    store = data.get("store")
    if "store" in data and not set(data) & fields:
        if store is None:
            return {}
        if not isinstance(store, Mapping):
            raise ConfigError(f"store: must be a mapping, not {type(store).__name__} (from config file {path})")
        return dict(store)
    if data and not set(data) & fields and not any(
            difflib.get_close_matches(k, fields, n=1) for k in data):
        raise ConfigError(f"{path} is a connector config without a store section (keys: "
                          f"{', '.join(map(str, data))}): the store reads a file's store fields "
                          f"({', '.join(StoreConfig.__struct_fields__)}) or its store section")
    return data


def load_config(
    source: StoreConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> StoreConfig:
    """The store's entry point: a Struct (returned as is), a dict, a file path, or None.

    With None, ``MOONCAKE_KV_CONFIG`` names the file. ``MOONCAKE_KV_*`` variables naming a store
    field override a dict or file source. Raises ConfigError naming the bad field (and the variable
    or file that set it); logs a warning for a variable that looks like a store field's and is none.
    """
    if isinstance(source, StoreConfig):
        return source
    environ = os.environ if environ is None else environ
    check_variables(environ, [(StoreConfig, frozenset())], warn_any=False)
    if source is None and environ.get(CONFIG_FILE_ENV):
        source = environ[CONFIG_FILE_ENV]
    data: Mapping[str, Any]
    origin = None
    if isinstance(source, (str, os.PathLike)):
        data = _store_file(source)
        origin = f"config file {source}"
    elif isinstance(source, Mapping):
        data = source
    elif source is None:
        data = {}
    else:
        raise ConfigError(f"config source must be a dict, a path or a StoreConfig, not {type(source).__name__}")
    env = env_overrides(StoreConfig, environ)
    layers = [(origin, data)] if origin else []
    return decode(merge(data, env), StoreConfig, layers=[*layers, (variable_name, env)])
