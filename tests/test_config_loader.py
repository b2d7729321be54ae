"""One config loader for the store, the connector and the SGLang backend.

Files, ``MOONCAKE_KV_*`` variables, size strings and error messages are read by
``store_backend.config_loader`` for all three; these tests check that each source gives the same
Struct, that every closed choice is refused when the config is read (naming the field's full path
and the allowed values), and that the connector and SGLang configs answer like the store's.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mooncake_connector.config import ConnectorConfig, load_connector_config
from sglang_hicache.config import VLLM_ONLY_KEYS, BackendSettings, SglangOnlySettings, load_backend_settings
from store_backend.config import (
    MAX_BYTES,
    DramConfig,
    OffloadConfig,
    PromotionConfig,
    SsdConfig,
    StoreConfig,
    load_config,
)
from store_backend.config_loader import PROJECT_VARIABLES, ConfigError, parse_size
from store_backend.policies import registry
from store_backend.policies.lru import LruPolicy
from store_backend.ssd.factory import backend_names
from store_backend.ssd.io.factory import IO_ENGINE_NAMES, make_io_engine

MiB = 1 << 20

STORE = {"dram": {"capacity_bytes": "64MiB", "eviction_policy": "lru"},
         "ssd": {"path": "/tmp/kv-ssd", "capacity_bytes": "2GB", "backend": "file", "io_engine": "posix"},
         "offload": {"policy": "watermark", "batch_bytes": "8MiB"}}
STORE_ENV = {"MOONCAKE_KV_DRAM__CAPACITY_BYTES": "64MiB", "MOONCAKE_KV_DRAM__EVICTION_POLICY": "lru",
             "MOONCAKE_KV_SSD__PATH": "/tmp/kv-ssd", "MOONCAKE_KV_SSD__CAPACITY_BYTES": "2GB",
             "MOONCAKE_KV_SSD__BACKEND": "file", "MOONCAKE_KV_SSD__IO_ENGINE": "posix",
             "MOONCAKE_KV_OFFLOAD__POLICY": "watermark", "MOONCAKE_KV_OFFLOAD__BATCH_BYTES": "8MiB"}


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    p = tmp_path / name
    if name.endswith(".json"):
        p.write_text(json.dumps(data))
    else:
        import yaml
        p.write_text(yaml.safe_dump(data))
    return p


def test_file_env_and_dict_give_the_same_store_config(tmp_path: Path) -> None:
    expected = load_config(STORE, environ={})
    assert expected.dram.capacity_bytes == 64 * MiB and expected.ssd is not None
    assert expected.ssd.capacity_bytes == 2 * 10**9 and expected.offload.batch_bytes == 8 * MiB
    assert load_config(_write(tmp_path, "s.yaml", STORE), environ={}) == expected
    assert load_config(_write(tmp_path, "s.json", STORE), environ={}) == expected
    assert load_config(None, environ={"MOONCAKE_KV_CONFIG": str(tmp_path / "s.yaml")}) == expected
    assert load_config(None, environ=STORE_ENV) == expected


def test_file_env_and_dict_give_the_same_connector_config(tmp_path: Path) -> None:
    extra = {"chunk_tokens": 64, "staging_bytes": "16MiB", "save_decode": False, "store": STORE}
    expected = load_connector_config(extra, environ={})
    assert expected.store == load_config(STORE, environ={})
    f = _write(tmp_path, "c.yaml", extra)
    from_file = msgspec.structs.replace(expected, config_file=str(f))  # the file the loader read
    assert load_connector_config({"config_file": str(f)}, environ={}) == from_file
    assert load_connector_config({}, environ={"MOONCAKE_KV_CONFIG": str(f)}) == from_file
    # Every connector key by its name, every store field by its path in the store config.
    env = {**STORE_ENV, "MOONCAKE_KV_CHUNK_TOKENS": "64", "MOONCAKE_KV_STAGING_BYTES": "16MiB",
           "MOONCAKE_KV_SAVE_DECODE": "false"}
    assert load_connector_config({}, environ=env) == expected


def test_a_store_file_and_a_connector_file_are_both_read_by_store_and_connector(tmp_path: Path) -> None:
    store_file = _write(tmp_path, "store.yaml", STORE)
    conn_file = _write(tmp_path, "conn.json", {"chunk_tokens": 64, "store": STORE})
    expected = load_config(STORE, environ={})
    for f in (store_file, conn_file):
        assert load_config(f, environ={}) == expected
        assert load_connector_config({"config_file": str(f)}, environ={}).store == expected
        assert load_backend_settings({"config_file": str(f)}, environ={}).connector.store == expected


def test_layers_win_in_order_file_then_dict_then_environment(tmp_path: Path) -> None:
    f = _write(tmp_path, "c.yaml", {"io_workers": 3, "chunk_tokens": 512,
                                     "store": {"dram": {"capacity_bytes": "8MiB", "eviction_policy": "fifo"}}})
    cfg = load_connector_config(
        {"config_file": str(f), "chunk_tokens": 128, "store": {"dram": {"capacity_bytes": "16MiB"}}},
        environ={"MOONCAKE_KV_CHUNK_TOKENS": "64", "MOONCAKE_KV_SSD__PATH": "/tmp/kv"})
    assert (cfg.io_workers, cfg.chunk_tokens) == (3, 64)
    store = cfg.store_config()
    # Section by section: the dict's dram.capacity_bytes wins, the file's eviction_policy stays.
    assert store.dram.capacity_bytes == 16 * MiB and store.dram.eviction_policy == "fifo"
    assert store.ssd is not None and store.ssd.path == "/tmp/kv"


def test_environment_overrides_a_nested_field_of_each_config(tmp_path: Path) -> None:
    env = {"MOONCAKE_KV_SSD__IO_ENGINE": "posix", "MOONCAKE_KV_PROMOTION__ADMISSION_HITS": "5"}
    extra = {"store": {"ssd": {"path": str(tmp_path)}}}
    store = load_config(extra["store"], environ=env)
    assert store.ssd is not None and store.ssd.io_engine == "posix" and store.promotion.admission_hits == 5
    assert load_connector_config(extra, environ=env).store == store
    assert load_backend_settings(extra, environ=env).connector.store == store
    assert load_backend_settings({}, environ={"MOONCAKE_KV_KV_DTYPE": "fp8_e4m3"}).sglang.kv_dtype == "fp8_e4m3"


def test_a_variable_for_a_text_field_keeps_its_text() -> None:
    # JSON would read these as numbers, which a revision or a path never is.
    cfg = load_connector_config({}, environ={"MOONCAKE_KV_REVISION": "1234567", "MOONCAKE_KV_SSD__PATH": "1e5",
                                             "MOONCAKE_KV_LOAD_TIMEOUT_S": "2.5"})
    assert cfg.revision == "1234567" and cfg.load_timeout_s == 2.5
    assert cfg.store is not None and cfg.store.ssd is not None and cfg.store.ssd.path == "1e5"


def test_a_typo_below_the_first_level_of_a_variable_is_refused_with_its_path() -> None:
    with pytest.raises(ConfigError, match=r"^store\.ssd\.io_engin: unknown field"):
        load_connector_config({}, environ={"MOONCAKE_KV_SSD__PATH": "/x", "MOONCAKE_KV_SSD__IO_ENGIN": "posix"})


def test_the_old_connector_file_variable_is_refused_naming_the_new_one() -> None:
    with pytest.raises(ConfigError, match="MOONCAKE_KV_CONNECTOR_CONFIG.*MOONCAKE_KV_CONFIG"):
        load_connector_config({}, environ={"MOONCAKE_KV_CONNECTOR_CONFIG": "/x.yaml"})


def _size_fields(cls: type[msgspec.Struct], prefix: str = "") -> list[str]:
    out = []
    for f in msgspec.structs.fields(cls):
        if f.name.endswith("_bytes"):
            out.append(prefix + f.name)
    return out


SIZE_FIELDS = (_size_fields(StoreConfig) + _size_fields(DramConfig, "dram.") + _size_fields(SsdConfig, "ssd.")
               + _size_fields(OffloadConfig, "offload.") + _size_fields(PromotionConfig, "promotion."))


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *sections, leaf = path.split(".")
    for s in sections:
        node = node.setdefault(s, {})
    node[leaf] = value
    if "ssd" in out:
        out["ssd"].setdefault("path", "/tmp/kv")
    return out


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_size_field_is_found() -> None:
    assert {"max_object_bytes", "dram.capacity_bytes", "dram.alignment_bytes", "ssd.capacity_bytes",
            "ssd.bucket_size_bytes", "offload.batch_bytes"} <= set(SIZE_FIELDS)


@pytest.mark.parametrize("path", SIZE_FIELDS)
@pytest.mark.parametrize("text", ["8MiB", "8 MiB", "8388608", "0.0078125GiB"])
def test_a_size_string_means_the_same_in_every_size_field_and_every_source(path: str, text: str) -> None:
    assert parse_size(text) == 8 * MiB
    data = _nest(path, text)
    env = {"MOONCAKE_KV_" + path.upper().replace(".", "__"): text}
    if "ssd" in data:
        env["MOONCAKE_KV_SSD__PATH"] = "/tmp/kv"
    assert _get(load_config(data, environ={}), path) == 8 * MiB
    assert _get(load_config(None, environ=env), path) == 8 * MiB
    assert _get(load_connector_config({"store": data}, environ={}).store, path) == 8 * MiB
    assert _get(load_connector_config({}, environ=env).store, path) == 8 * MiB
    assert _get(load_backend_settings({"store": data}, environ={}).connector.store, path) == 8 * MiB


def test_the_connector_sizes_use_the_same_parser() -> None:
    assert load_connector_config({"staging_bytes": "8 MiB"}, environ={}).staging_bytes == 8 * MiB
    assert load_connector_config({}, environ={"MOONCAKE_KV_STAGING_BYTES": "8MiB"}).staging_bytes == 8 * MiB
    assert load_backend_settings({"staging_bytes": "8MiB"}, environ={}).connector.staging_bytes == 8 * MiB


@pytest.mark.parametrize("load, data, message", [
    (load_config, {"dram": {"capacity_bytes": "12 parsecs"}}, "dram.capacity_bytes: not a size: '12 parsecs'"),
    (load_connector_config, {"store": {"dram": {"capacity_bytes": "12 parsecs"}}},
     "store.dram.capacity_bytes: not a size: '12 parsecs'"),
    (load_connector_config, {"staging_bytes": "lots"}, "staging_bytes: not a size: 'lots'"),
    (load_backend_settings, {"store": {"ssd": {"path": "/x", "capacity_bytes": "big"}}},
     "store.ssd.capacity_bytes: not a size: 'big'"),
])
def test_a_bad_size_names_the_full_path_and_the_value(load, data, message) -> None:
    with pytest.raises(ConfigError) as e:
        load(data, environ={})
    assert str(e.value).startswith(message)


# (loader, data, full path, a name the message must list as allowed)
CLOSED_CHOICES = [
    (load_config, {"dram": {"eviction_policy": "clairvoyant"}}, "dram.eviction_policy", "prefix_reuse"),
    (load_config, {"ssd": {"path": "/x", "backend": "tape"}}, "ssd.backend", "bucket"),
    (load_config, {"ssd": {"path": "/x", "io_engine": "aio"}}, "ssd.io_engine", "io_uring"),
    (load_config, {"ssd": {"path": "/x", "bucket_eviction": "random"}}, "ssd.bucket_eviction", "lru"),
    (load_config, {"ssd": {"path": "/x", "admission_policy": "sometimes"}}, "ssd.admission_policy", "reused"),
    (load_config, {"offload": {"policy": "lazy"}}, "offload.policy", "watermark"),
    (load_connector_config, {"store": {"dram": {"eviction_policy": "clairvoyant"}}}, "store.dram.eviction_policy",
     "lru"),
    (load_connector_config, {"store": {"ssd": {"path": "/x", "backend": "tape"}}}, "store.ssd.backend", "offset"),
    (load_connector_config, {"hash_scheme": "md5"}, "hash_scheme", "xxh3_128"),
    (load_backend_settings, {"hash_scheme": "xxh3_128"}, "hash_scheme", "sglang"),
    (load_backend_settings, {"store": {"ssd": {"path": "/x", "io_engine": "aio"}}}, "store.ssd.io_engine", "posix"),
]


@pytest.mark.parametrize("load, data, path, allowed", CLOSED_CHOICES)
def test_every_closed_choice_is_refused_when_read_naming_the_field_and_the_choices(load, data, path, allowed) -> None:
    with pytest.raises(ConfigError) as e:
        load(data, environ={})
    text = str(e.value)
    assert text.startswith(f"{path}: "), text
    assert repr(allowed) in text, text


def test_a_closed_choice_from_the_environment_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^dram\.eviction_policy: unknown value 'mru' \(known: .*'lru'"):
        load_config(None, environ={"MOONCAKE_KV_DRAM__EVICTION_POLICY": "mru"})


def test_the_config_names_exactly_the_ssd_backends_and_io_engines_there_are() -> None:
    fields = {f.name: f.type for f in msgspec.structs.fields(SsdConfig)}
    assert sorted(typing.get_args(fields["backend"])) == backend_names()
    assert sorted(typing.get_args(fields["io_engine"])) == sorted(IO_ENGINE_NAMES)
    with pytest.raises(ValueError, match="io_engine"):
        make_io_engine("aio")  # the factory refuses what the config refuses


def test_a_registered_eviction_policy_is_accepted_by_the_config() -> None:
    with pytest.raises(ConfigError, match="dram.eviction_policy"):
        load_config({"dram": {"eviction_policy": "lru_again"}}, environ={})
    registry.register_policy("lru_again", LruPolicy)
    try:
        assert load_config({"dram": {"eviction_policy": "lru_again"}},
                           environ={}).dram.eviction_policy == "lru_again"
    finally:
        registry.unregister_policy("lru_again")
    with pytest.raises(ConfigError, match="dram.eviction_policy"):
        load_config({"dram": {"eviction_policy": "lru_again"}}, environ={})


@pytest.mark.parametrize("load, data, message", [
    (load_config, {"ssd": {"path": "/x", "bakend": "file"}}, "ssd.bakend: unknown field (known: path, "),
    (load_connector_config, {"store": {"ssd": {"path": "/x", "bakend": "file"}}}, "store.ssd.bakend: unknown field"),
    (load_connector_config, {"chunk_token": 64}, "chunk_token: unknown field (known: chunk_tokens, "),
    (load_backend_settings, {"store": {"drm": {}}}, "store.drm: unknown field (known: dram, ssd, "),
])
def test_an_unknown_field_is_refused_naming_its_full_path_and_the_known_ones(load, data, message) -> None:
    with pytest.raises(ConfigError) as e:
        load(data, environ={})
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize("load, data, message", [
    (load_config, {"dram": {"capacity_bytes": [1]}}, "dram.capacity_bytes: expected int, got array [1]"),
    (load_config, {"dram": {"alignment_bytes": 3000}}, "dram.alignment_bytes: must be a power of two, got 3000"),
    (load_config, {"offload": {"low_watermark": 0.95}}, "offload.low_watermark: 0.95 must be below high_watermark"),
    (load_config, {"ssd": {"capacity_bytes": 1 << 30}}, "ssd.path: required"),
    (load_connector_config, {"store": {"dram": {"alignment_bytes": 3000}}},
     "store.dram.alignment_bytes: must be a power of two, got 3000"),
    (load_connector_config, {"chunk_tokens": "many"}, "chunk_tokens: expected int, got str 'many'"),
    (load_connector_config, {"lookup_wait_s": -1}, "lookup_wait_s: must be >= 0, got -1"),
    (load_backend_settings, {"kv_dtype": 8}, "kv_dtype: expected str | null, got int 8"),
])
def test_a_bad_value_is_refused_naming_its_full_path_and_the_value(load, data, message) -> None:
    with pytest.raises(ConfigError) as e:
        load(data, environ={})
    assert str(e.value).startswith(message), str(e.value)


def test_the_connector_store_section_is_the_store_loaders_answer() -> None:
    # The same store text through the store, the connector and the SGLang backend: one Struct, and
    # for a bad value one message (under "store." for the connectors).
    assert load_connector_config({"store": STORE}, environ={}).store == load_config(STORE, environ={})
    assert load_backend_settings({"store": STORE}, environ={}).connector.store == load_config(STORE, environ={})
    bad = {"ssd": {"path": "/x", "queue_depth": 0}}
    messages = []
    for load, data in ((load_config, bad), (load_connector_config, {"store": bad}),
                       (load_backend_settings, {"store": bad})):
        with pytest.raises(ConfigError) as e:
            load(data, environ={})
        messages.append(str(e.value))
    assert messages == ["ssd.queue_depth: must be > 0, got 0"] + ["store.ssd.queue_depth: must be > 0, got 0"] * 2


def test_a_store_struct_given_to_the_connector_is_kept() -> None:
    store = load_config(STORE, environ={})
    cfg = load_connector_config({"store": store}, environ={})
    assert isinstance(cfg, ConnectorConfig) and cfg.store == store


# ---- no field that does nothing -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
CONFIG_MODULES = {"store_backend/config.py", "store_backend/config_loader.py", "mooncake_connector/config.py",
                  "sglang_hicache/config.py"}
# Structs that hold other config Structs as sections (``store.dram``, ``settings.connector``).
PARENTS = (StoreConfig, ConnectorConfig, BackendSettings)
PACKAGES = ("store_backend", "mooncake_connector", "vllm_plugin", "sglang_hicache", "mooncake_kv")


def _source(*packages: str) -> dict[str, str]:
    """Production code of ``packages`` by path, without the config modules (which declare the fields)."""
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))
            if str(p.relative_to(ROOT)) not in CONFIG_MODULES}


def _last(node: ast.AST) -> str | None:
    """The last name of ``a.b.c`` (``c``), of ``f()`` (``f``), of ``a.b()`` (``b``)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _mentions(annotation: ast.AST | None, name: str) -> bool:
    return annotation is not None and any(isinstance(n, ast.Name) and n.id == name or
                                          isinstance(n, ast.Constant) and isinstance(n.value, str) and name in n.value
                                          for n in ast.walk(annotation))


@functools.cache
def _producers(cls: type[msgspec.Struct]) -> frozenset[str]:
    """Functions (in the config modules too) annotated to return ``cls``: ``x = load_config(...)``."""
    out: set[str] = set()
    for path in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        tree = _parse(path.read_text())
        out |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.returns is not None and isinstance(n.returns, ast.Name) and n.returns.id == cls.__name__}
    return frozenset(out)


def _aliases(cls: type[msgspec.Struct], tree: ast.AST, producers: frozenset[str]) -> set[str]:
    """Names in one module that hold a ``cls``: its section names (``x.promotion``), names annotated
    with it (``cfg: SsdConfig``), and names assigned from one of those or from a producer call
    (``off = self.config.offload``, ``self.cfg = cfg``, ``cfg = load_connector_config(...)``)."""
    names = {f.name for parent in PARENTS for f in msgspec.structs.fields(parent)
             if cls.__name__ in str(f.type) and cls is not parent}
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and _mentions(n.annotation, cls.__name__):
            names.add(n.arg)
        elif isinstance(n, ast.AnnAssign) and _mentions(n.annotation, cls.__name__) and _last(n.target):
            names.add(_last(n.target))  # type: ignore[arg-type]
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    while True:
        grown = {_last(t) for a in assigns for t in a.targets
                 if (_last(a.value) in names and not isinstance(a.value, ast.Call))
                 or (isinstance(a.value, ast.Call) and _last(a.value) in producers)} - {None} - names
        if not grown:
            return names
        names |= grown  # type: ignore[arg-type]


@functools.lru_cache(maxsize=512)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)


def _unread(cls: type[msgspec.Struct], sources: dict[str, str], exempt: set[str]) -> list[str]:
    """Fields of ``cls`` that no code reads as ``<a name holding a cls>.<field>``.

    Parsed, so comments, docstrings and strings do not count, and qualified: ``off.queue_max_objects``
    (off holding the offload section) is no read of ``promotion.queue_max_objects``.
    """
    producers = _producers(cls)
    read: set[str] = set()
    for text in sources.values():
        tree = _parse(text)
        holders = _aliases(cls, tree, producers)
        read |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)
                 and _last(n.value) in holders}
    return [f for f in cls.__struct_fields__ if f not in exempt and f not in read]


def test_every_store_field_is_read_by_the_store() -> None:
    source = _source("store_backend")
    for cls in (StoreConfig, DramConfig, SsdConfig, OffloadConfig, PromotionConfig):
        assert _unread(cls, source, set()) == [], cls.__name__


def test_the_unread_field_check_fails_when_a_read_is_removed() -> None:
    # offload.queue_max_objects is read too (as off.queue_max_objects), so a check by the bare
    # name would not notice promotion's one read going away.
    source = _source("store_backend")
    assert _unread(PromotionConfig, source, set()) == []
    mutated = {p: t.replace("self.config.promotion.queue_max_objects", "4096") for p, t in source.items()}
    assert mutated != source
    assert _unread(PromotionConfig, mutated, set()) == ["queue_max_objects"]
    # A field named only in a comment, a docstring or a string is not read.
    for text in ('"self.config.promotion.queue_max_objects"', "4096  # self.config.promotion.queue_max_objects\n"):
        quoted = {p: t.replace("self.config.promotion.queue_max_objects", text) for p, t in source.items()}
        assert _unread(PromotionConfig, quoted, set()) == ["queue_max_objects"], text
    # The connector's keys the same way: flush_timeout_s is read only through the worker's self.cfg.
    connector = _source("vllm_plugin", "mooncake_connector")
    without = {p: t.replace("self.cfg.flush_timeout_s", "120.0") for p, t in connector.items()}
    assert without != connector
    assert _unread(ConnectorConfig, without, {"store", "config_file"}) == ["flush_timeout_s"]


def test_a_struct_nobody_holds_is_unread() -> None:
    class Unused(msgspec.Struct):
        path: str = ""
        policy: str = ""
        enabled: bool = True

    assert _unread(Unused, _source("store_backend"), set()) == ["path", "policy", "enabled"]


def test_every_connector_key_is_read_by_the_vllm_connector() -> None:
    # store: read through store_config(); config_file: read by the loader itself.
    assert _unread(ConnectorConfig, _source("vllm_plugin", "mooncake_connector"), {"store", "config_file"}) == []


def test_the_sglang_backend_reads_every_connector_key_but_the_vllm_only_ones() -> None:
    source = _source("sglang_hicache")
    # chunk_tokens: read as BackendSettings.chunk_tokens_given; hash_scheme: always "sglang".
    exempt = {"store", "config_file", "chunk_tokens", "hash_scheme"}
    assert _unread(ConnectorConfig, source, exempt | set(VLLM_ONLY_KEYS)) == []
    assert _unread(SglangOnlySettings, source, set()) == []
    assert VLLM_ONLY_KEYS <= set(ConnectorConfig.__struct_fields__)
    # A vLLM-only key that SGLang starts to read must leave VLLM_ONLY_KEYS (and the docs' list).
    assert sorted(set(_unread(ConnectorConfig, source, exempt))) == sorted(VLLM_ONLY_KEYS)


def test_the_sglang_backend_logs_the_keys_it_ignores(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="sglang_hicache.config"):
        load_backend_settings({"save_decode": False, "io_workers": 3, "staging_bytes": "8MiB"}, environ={})
    assert "io_workers, save_decode only read by the vLLM connector" in caplog.text


# ---- variables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, get", [
    ("MOONCAKE_KV_DRAM__SHM_NAME", lambda c: c.store_config().dram.shm_name),
    ("MOONCAKE_KV_MODEL_ID", lambda c: c.model_id),
    ("MOONCAKE_KV_REVISION", lambda c: c.revision),
    ("MOONCAKE_KV_LOOKUP_SOCKET_DIR", lambda c: c.lookup_socket_dir),
])
def test_null_from_a_variable_unsets_an_optional_text_field(name, get) -> None:
    # A model_id "null" would turn off the weights stamp: KV of other weights could be served.
    given = {"model_id": "m", "revision": "r", "lookup_socket_dir": "/tmp", "store": {"dram": {"shm_name": "kvseg"}}}
    assert get(load_connector_config(given, environ={})) is not None
    assert get(load_connector_config(given, environ={name: "null"})) is None
    assert load_config({"dram": {"shm_name": "kvseg"}},
                       environ={"MOONCAKE_KV_DRAM__SHM_NAME": "null"}).dram.shm_name is None


def test_null_for_a_text_field_that_cannot_be_unset_stays_text() -> None:
    cfg = load_config(None, environ={"MOONCAKE_KV_SSD__PATH": "null"})
    assert cfg.ssd is not None and cfg.ssd.path == "null"


def test_a_json_string_from_a_variable_means_its_text_for_every_field() -> None:
    env = {"MOONCAKE_KV_SSD__PATH": '"/x"', "MOONCAKE_KV_SSD__BACKEND": '"file"',
           "MOONCAKE_KV_DRAM__EVICTION_POLICY": '"lru"', "MOONCAKE_KV_SSD__ADMISSION_POLICY": '"all"'}
    cfg = load_config(None, environ=env)
    assert cfg.ssd is not None and (cfg.ssd.path, cfg.ssd.backend, cfg.ssd.admission_policy) == ("/x", "file", "all")
    assert cfg.dram.eviction_policy == "lru"
    assert load_connector_config({}, environ={"MOONCAKE_KV_MODEL_ID": '"org/m"'}).model_id == "org/m"


@pytest.mark.parametrize("name, instead", [
    ("MOONCAKE_KV_STORE__DRAM__CAPACITY_BYTES", "MOONCAKE_KV_DRAM__CAPACITY_BYTES"),
    ("MOONCAKE_KV_STORE", "MOONCAKE_KV_DRAM__CAPACITY_BYTES"),
    ("MOONCAKE_KV_CONFIG_FILE", "MOONCAKE_KV_CONFIG"),
    ("MOONCAKE_KV_CONNECTOR_CONFIG", "MOONCAKE_KV_CONFIG"),
])
def test_a_variable_a_user_may_mean_for_a_setting_is_refused_naming_it(name: str, instead: str) -> None:
    for load in (load_config, load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError) as e:
            load({}, environ={name: "8MiB"})
        assert str(e.value).startswith(f"{name}: ") and instead in str(e.value), str(e.value)


@pytest.mark.parametrize("name, nearest", [
    ("MOONCAKE_KV_DRAM_CAPACITY_BYTES", "MOONCAKE_KV_DRAM__CAPACITY_BYTES"),
    ("MOONCAKE_KV_DRM__CAPACITY_BYTES", "MOONCAKE_KV_DRAM__CAPACITY_BYTES"),
    ("MOONCAKE_KV_CHUNK_TOKEN", "MOONCAKE_KV_CHUNK_TOKENS"),
    ("MOONCAKE_KV_KV_DTYP", "MOONCAKE_KV_KV_DTYPE"),
])
def test_a_variable_that_matches_no_setting_is_warned_with_the_nearest_name(caplog, name: str, nearest: str) -> None:
    # A warning, not an error: the environment is shared with other tools.
    with caplog.at_level(logging.WARNING, logger="store_backend.config_loader"):
        load_backend_settings({}, environ={name: "8"})
    assert f"{name} matches no setting and is ignored; did you mean {nearest}?" in caplog.text
    if "DRAM" in nearest:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="store_backend.config_loader"):
            load_config(None, environ={name: "8MiB"})
        assert f"did you mean {nearest}?" in caplog.text


def test_the_projects_own_variables_and_other_configs_keys_are_not_warned(caplog) -> None:
    env = {n: "x" for n in ("MOONCAKE_KV_VENV", "MOONCAKE_KV_TORCH_INDEX", "MOONCAKE_KV_SGLANG_CONFIG",
                            "MOONCAKE_KV_SGLANG_EXTRAS", "MOONCAKE_KV_TRACES")}
    with caplog.at_level(logging.WARNING, logger="store_backend.config_loader"):
        load_backend_settings({}, environ=env)
        load_connector_config({}, environ=env)
        # The store alone does not read connector keys, and does not warn about them.
        connector_env = {"MOONCAKE_KV_" + f.upper(): "1" for cls in (ConnectorConfig, SglangOnlySettings)
                         for f in cls.__struct_fields__ if f not in ("store", "config_file")}
        assert "MOONCAKE_KV_SHARED_SSD" in connector_env  # close to MOONCAKE_KV_SSD with the prefix counted
        load_config(None, environ={**env, **connector_env})
    assert caplog.text == ""


def test_every_project_variable_that_is_no_setting_is_in_the_allowlist() -> None:
    # The scripts', examples' and tests' own MOONCAKE_KV_* variables must not be warned about.
    config_tests = {"tests/test_config_loader.py", "tests/store_backend/test_config.py",
                    "tests/mooncake_connector/test_config.py"}
    files = [p for pattern in ("*.py", "*.sh") for p in ROOT.rglob(pattern)
             if ".git" not in p.parts and "egg-info" not in str(p)
             and str(p.relative_to(ROOT)) not in CONFIG_MODULES | config_tests]
    used = {m for p in files for m in re.findall(r"MOONCAKE_KV_[A-Z0-9_]*[A-Z0-9]", p.read_text(errors="replace"))}
    fields = {f for cls in (StoreConfig, ConnectorConfig, SglangOnlySettings) for f in cls.__struct_fields__}
    others = {n for n in used if n[len("MOONCAKE_KV_"):].split("__")[0].lower() not in fields}
    assert "MOONCAKE_KV_VENV" in others  # the scan finds the scripts' variables
    assert others - {"MOONCAKE_KV_CONFIG", "MOONCAKE_KV_CONNECTOR_CONFIG"} <= PROJECT_VARIABLES


@pytest.mark.parametrize("field", ["lookup_wait_s", "load_timeout_s", "lease_ttl_s", "remote_prefill_wait_s",
                                   "flush_timeout_s"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_timeout_from_a_variable_is_refused_naming_it(field: str, value: str) -> None:
    name = "MOONCAKE_KV_" + field.upper()
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match=f"^{field}: must be a finite number of seconds.*{name}"):
            load({}, environ={name: value})


def test_a_non_finite_timeout_from_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    j = tmp_path / "c.json"
    j.write_text('{"lookup_wait_s": Infinity}')
    y = tmp_path / "c.yaml"
    y.write_text("remote_prefill_wait_s: .nan\n")
    with pytest.raises(ConfigError, match=rf"^lookup_wait_s: must be a finite .*{re.escape(str(j))}"):
        load_connector_config({"config_file": str(j)}, environ={})
    with pytest.raises(ConfigError, match=rf"^remote_prefill_wait_s: must be a finite .*{re.escape(str(y))}"):
        load_connector_config({"config_file": str(y)}, environ={})
    with pytest.raises(ConfigError, match="^load_timeout_s: must be a finite"):
        load_connector_config({"load_timeout_s": float("nan")}, environ={})
    with pytest.raises(ValueError, match="^flush_timeout_s: must be a finite"):
        ConnectorConfig(flush_timeout_s=float("inf"))


def test_an_error_from_a_variable_or_a_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^store\.dram\.capacity_bytes: not a size: '12 parsecs'.*"
                                          r"\(from MOONCAKE_KV_DRAM__CAPACITY_BYTES\)$"):
        load_connector_config({}, environ={"MOONCAKE_KV_DRAM__CAPACITY_BYTES": "12 parsecs"})
    with pytest.raises(ConfigError, match=r"^dram\.capacity_bytes: .*\(from MOONCAKE_KV_DRAM__CAPACITY_BYTES\)$"):
        load_config(None, environ={"MOONCAKE_KV_DRAM__CAPACITY_BYTES": "12 parsecs"})
    with pytest.raises(ConfigError, match=r"^chunk_tokens: expected int.*\(from MOONCAKE_KV_CHUNK_TOKENS\)$"):
        load_connector_config({}, environ={"MOONCAKE_KV_CHUNK_TOKENS": "many"})
    f = _write(tmp_path, "c.yaml", {"io_workers": 0})
    g = _write(tmp_path, "g.yaml", {"store": {"dram": {"eviction_policy": "mru"}}})
    in_f = re.escape(f"(from config file {f})")
    with pytest.raises(ConfigError, match=rf"^io_workers: must be > 0, got 0 {in_f}$"):
        load_connector_config({"config_file": str(f)}, environ={})
    with pytest.raises(ConfigError, match=rf"^store\.dram\.eviction_policy: unknown value 'mru'.*{re.escape(str(g))}"):
        load_connector_config({"config_file": str(g)}, environ={})
    # What the dict itself sets is the caller's: no source added.
    with pytest.raises(ConfigError) as e:
        load_connector_config({"config_file": str(f), "io_workers": -1}, environ={})
    assert str(e.value) == "io_workers: must be > 0, got -1"
    s = _write(tmp_path, "s.yaml", {"dram": {"alignment_bytes": 3000}})
    with pytest.raises(ConfigError, match=rf"^dram\.alignment_bytes: must be a power .*{re.escape(str(s))}"):
        load_config(s, environ={})


# ---- sizes ---------------------------------------------------------------------------------------


def test_a_size_is_parsed_exactly() -> None:
    assert parse_size(str(MAX_BYTES + 1)) == MAX_BYTES + 1
    assert parse_size("1.5KiB") == 1536 and parse_size("0.5K") == 500 and parse_size("1.000001M") == 1000001
    assert parse_size("99999999999999999999999") == 99999999999999999999999
    # The max check sees the exact number (a float rounds MAX_BYTES + 1 down to MAX_BYTES).
    with pytest.raises(ConfigError, match="^max_object_bytes: must be at most"):
        load_config({"max_object_bytes": str(MAX_BYTES + 1)}, environ={})
    with pytest.raises(ConfigError, match="^dram.capacity_bytes: must be at most"):
        load_config(None, environ={"MOONCAKE_KV_DRAM__CAPACITY_BYTES": str(MAX_BYTES + 1) + "B"})


@pytest.mark.parametrize("text", ["0.5B", "4096.9", "1.0000001KiB", "4.0959999KiB", "\u0663", "\u0663KiB", "1e3",
                                  "8Ki", "-1", "+5", ".5GiB"])
def test_a_size_that_is_no_whole_number_of_bytes_or_not_ascii_digits_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
    with pytest.raises(ConfigError, match=r"^dram\.capacity_bytes: not a"):
        load_config({"dram": {"capacity_bytes": text}}, environ={})


# ---- files and shapes ------------------------------------------------------------------------------


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"dram:\n  shm_name: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^cannot read config file {re.escape(str(f))}: not UTF-8"):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match=r"^config_file: cannot read config file .*latin1\.yaml: not UTF-8"):
        load_connector_config({"config_file": str(f)}, environ={})
    with pytest.raises(ConfigError, match=r"latin1\.yaml: not UTF-8.*\(from MOONCAKE_KV_CONFIG\)"):
        load_connector_config({}, environ={"MOONCAKE_KV_CONFIG": str(f)})


@pytest.mark.parametrize("extra", [["chunk_tokens"], "chunk_tokens=64", 64])
def test_an_extra_config_that_is_no_mapping_is_a_config_error(extra) -> None:
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match="^the extra config must be a mapping"):
            load(extra, environ={})


@pytest.mark.parametrize("load, data, message", [
    (load_config, {"dram": {1: 2}}, "dram: key 1 is not a field name"),
    (load_config, {1: 2}, "key 1 is not a field name"),
    (load_connector_config, {"store": {"ssd": {"path": "/x", None: 1}}}, "store.ssd: key None is not a field name"),
    (load_backend_settings, {"store": {"dram": {True: 1}}}, "store.dram: key True is not a field name"),
])
def test_a_key_that_is_not_text_is_refused_naming_its_section(load, data, message) -> None:
    with pytest.raises(ConfigError) as e:
        load(data, environ={})
    assert str(e.value) == message


def test_a_config_file_naming_another_is_refused(tmp_path: Path) -> None:
    other = _write(tmp_path, "other.yaml", {"io_workers": 3})
    f = _write(tmp_path, "c.yaml", {"config_file": str(other), "chunk_tokens": 64})
    with pytest.raises(ConfigError, match=r"^config_file: .*c\.yaml names another config file .*other\.yaml"):
        load_connector_config({"config_file": str(f)}, environ={})


def test_the_store_refuses_a_connector_file_without_a_store_section(tmp_path: Path) -> None:
    f = _write(tmp_path, "c.yaml", {"chunk_tokens": 64, "save_decode": False})
    message = rf"^{re.escape(str(f))} is a connector config without a store section \(keys: chunk_tokens, save_decode\)"
    with pytest.raises(ConfigError, match=message):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match=message):
        load_config(None, environ={"MOONCAKE_KV_CONFIG": str(f)})
    # The connector reads it with the default store; with a store section the store reads that.
    assert load_connector_config({"config_file": str(f)}, environ={}).store is None
    g = _write(tmp_path, "g.yaml", {"chunk_tokens": 64, "store": {"dram": {"capacity_bytes": "8MiB"}}})
    assert load_config(g, environ={}).dram.capacity_bytes == 8 * MiB
    # A store file with a typo is still read as a store file (the typo refused by name).
    h = _write(tmp_path, "h.yaml", {"drm": {"capacity_bytes": "8MiB"}})
    with pytest.raises(ConfigError, match=r"^drm: unknown field \(known: dram, .*did you mean dram\?\)"):
        load_config(h, environ={})


def test_a_typo_in_a_connector_file_lists_connector_keys_and_store_fields(tmp_path: Path) -> None:
    f = _write(tmp_path, "c.yaml", {"chunk_token": 64})
    with pytest.raises(ConfigError) as e:
        load_connector_config({"config_file": str(f)}, environ={})
    text = str(e.value)
    assert text.startswith("chunk_token: unknown key (connector keys: "), text
    assert "store fields: dram, ssd, offload, promotion, max_object_bytes" in text and "save_decode" in text, text
    assert "did you mean chunk_tokens?" in text and str(f) in text, text
    mixed = _write(tmp_path, "m.yaml", {"chunk_tokens": 64, "dram": {"capacity_bytes": "8MiB"}})
    with pytest.raises(ConfigError, match=r"^dram: a store field at the top of a connector config.*under store"):
        load_connector_config({"config_file": str(mixed)}, environ={})
    # In the dict, an unknown key gets the nearest name too.
    with pytest.raises(ConfigError, match=r"^chunk_token: unknown field \(known: .*did you mean chunk_tokens\?\)"):
        load_connector_config({"chunk_token": 64}, environ={})


def test_hash_scheme_is_refused_like_every_closed_choice() -> None:
    with pytest.raises(ConfigError) as e:
        load_connector_config({"hash_scheme": "XXH3"}, environ={})
    assert str(e.value) == "hash_scheme: unknown value 'XXH3' (known: 'sglang', 'xxh3_128')"


@pytest.mark.parametrize("path", ["/mnt/kv ", " /mnt/kv", "/mnt/kv\n"])
def test_an_ssd_path_with_white_space_at_an_end_is_refused_not_stripped(path: str) -> None:
    with pytest.raises(ConfigError, match=r"^ssd\.path: starts or ends with white space"):
        load_config(None, environ={"MOONCAKE_KV_SSD__PATH": path})
    with pytest.raises(ConfigError, match=r"^store\.ssd\.path: starts or ends with white space"):
        load_connector_config({"store": {"ssd": {"path": path}}}, environ={})


# ---- SGLang: the merged data is split ---------------------------------------------------------------


def test_sglang_only_keys_are_read_from_a_file_and_a_variable(tmp_path: Path) -> None:
    f = _write(tmp_path, "sg.json", {"kv_dtype": "fp8_e4m3", "quantization": "fp8"})
    settings = load_backend_settings({"config_file": str(f)}, environ={})
    assert (settings.sglang.kv_dtype, settings.sglang.quantization) == ("fp8_e4m3", "fp8")
    # Layers as for every key: the dict over the file, a variable over both.
    assert load_backend_settings({"config_file": str(f), "kv_dtype": "fp8_e5m2"},
                                 environ={}).sglang.kv_dtype == "fp8_e5m2"
    assert load_backend_settings({"config_file": str(f), "kv_dtype": "fp8_e5m2"},
                                 environ={"MOONCAKE_KV_KV_DTYPE": "int8"}).sglang.kv_dtype == "int8"
    empty = _write(tmp_path, "empty.json", {"kv_dtype": ""})
    with pytest.raises(ConfigError, match=rf"^kv_dtype: must not be empty \(from config file {re.escape(str(empty))}"):
        load_backend_settings({"config_file": str(empty)}, environ={})


def test_sglang_chunk_tokens_from_a_file_counts_as_given(tmp_path: Path) -> None:
    f = _write(tmp_path, "sg.json", {"chunk_tokens": 64})
    assert load_backend_settings({"config_file": str(f)}, environ={}).chunk_tokens_given == 64
    assert load_backend_settings({}, environ={"MOONCAKE_KV_CHUNK_TOKENS": "32"}).chunk_tokens_given == 32
    assert load_backend_settings({}, environ={}).chunk_tokens_given is None


def test_sglang_logs_the_vllm_only_keys_of_a_file_and_a_variable(tmp_path: Path, caplog) -> None:
    f = _write(tmp_path, "sg.yaml", {"io_workers": 3})
    with caplog.at_level(logging.INFO, logger="sglang_hicache.config"):
        load_backend_settings({"config_file": str(f)}, environ={"MOONCAKE_KV_SAVE_DECODE": "false"})
    assert "io_workers, save_decode only read by the vLLM connector" in caplog.text


def test_sglang_refuses_another_hash_scheme_from_a_file_naming_it(tmp_path: Path) -> None:
    f = _write(tmp_path, "sg.json", {"hash_scheme": "xxh3_128"})
    with pytest.raises(ConfigError, match=rf"^hash_scheme: unknown value 'xxh3_128' for SGLang .*{re.escape(str(f))}"):
        load_backend_settings({"config_file": str(f)}, environ={})
    with pytest.raises(ConfigError, match=r"^hash_scheme: .*\(from MOONCAKE_KV_HASH_SCHEME\)"):
        load_backend_settings({}, environ={"MOONCAKE_KV_HASH_SCHEME": "xxh3_128"})


def test_sglang_refuses_its_own_keys_in_a_file_where_sglang_does_not_read_them(tmp_path: Path) -> None:
    f = _write(tmp_path, "sg.json", {"interface_v1": 1, "chunk_tokens": 64})
    with pytest.raises(ConfigError, match=r"^interface_v1: read by the engine from its extra config only.*sg\.json"):
        load_backend_settings({"config_file": str(f)}, environ={})
    # In the dict they are SGLang's, and left to it.
    assert load_backend_settings({"interface_v1": 1, "backend_name": "x"}, environ={}).chunk_tokens_given is None


def test_a_non_text_key_in_a_file_is_refused_as_such(tmp_path: Path) -> None:
    f = tmp_path / "yes.yaml"
    f.write_text("yes: 1\n")  # YAML 1.1 reads the key as True
    message = rf"^key True is not a field name {re.escape(f'(from config file {f})')}$"
    with pytest.raises(ConfigError, match=message):
        load_config(f, environ={})
    with pytest.raises(ConfigError, match=message):
        load_connector_config({"config_file": str(f)}, environ={})


def test_a_json_file_is_read_as_json_whatever_the_case_of_its_suffix(tmp_path: Path) -> None:
    f = tmp_path / "c.JSON"
    f.write_text('{"dram": {"capacity_bytes": "8MiB"}, "offload": {"policy": "watermark"}}')
    assert load_config(f, environ={}).offload.policy == "watermark"
    g = tmp_path / "i.JSON"
    g.write_text('{"lookup_wait_s": Infinity}')  # JSON's Infinity; YAML would read the text 'Infinity'
    with pytest.raises(ConfigError, match="^lookup_wait_s: must be a finite number of seconds"):
        load_connector_config({"config_file": str(g)}, environ={})
