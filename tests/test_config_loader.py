"""One config loader for the store, the connector and the SGLang backend.

Files, ``MOONCAKE_KV_*`` variables, size strings and error messages are read by
``store_backend.config_loader`` for all three; these tests check that each source gives the same
Struct, that every closed choice is refused when the config is read (naming the field's full path
and the allowed values), and that the connector and SGLang configs answer like the store's.
"""

from __future__ import annotations

import json
import logging
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mooncake_connector.config import ConnectorConfig, load_connector_config
from sglang_hicache.config import VLLM_ONLY_KEYS, SglangOnlySettings, load_backend_settings
from store_backend.config import DramConfig, OffloadConfig, PromotionConfig, SsdConfig, StoreConfig, load_config
from store_backend.config_loader import ConfigError, parse_size
from store_backend.policies import registry
from store_backend.policies.lru import LruPolicy
from store_backend.ssd.factory import backend_names
from store_backend.ssd.io.factory import make_io_engine

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
    assert set(typing.get_args(fields["io_engine"])) == {"auto", "io_uring", "posix"}
    with pytest.raises(ValueError, match="io_engine"):
        make_io_engine("aio")  # the factory refuses what the config refuses


def test_a_registered_eviction_policy_is_accepted_by_the_config(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="dram.eviction_policy"):
        load_config({"dram": {"eviction_policy": "lru_again"}}, environ={})
    monkeypatch.setitem(registry._FACTORIES, "lru_again", LruPolicy)
    assert load_config({"dram": {"eviction_policy": "lru_again"}}, environ={}).dram.eviction_policy == "lru_again"


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


def _source(*packages: str) -> str:
    """Production code of ``packages``, without the config modules (which declare the fields)."""
    return "\n".join(p.read_text() for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))
                     if str(p.relative_to(ROOT)) not in CONFIG_MODULES)


def _unread(cls: type[msgspec.Struct], source: str, exempt: set[str]) -> list[str]:
    return [f for f in cls.__struct_fields__ if f not in exempt and not re.search(rf"\.{f}\b", source)]


def test_every_store_field_is_read_by_the_store() -> None:
    source = _source("store_backend")
    for cls in (StoreConfig, DramConfig, SsdConfig, OffloadConfig, PromotionConfig):
        assert _unread(cls, source, set()) == [], cls.__name__


def test_every_connector_key_is_read_by_the_vllm_connector() -> None:
    # store: read through store_config(); config_file: read by the loader itself.
    assert _unread(ConnectorConfig, _source("vllm_plugin", "mooncake_connector"), {"store", "config_file"}) == []


def test_the_sglang_backend_reads_every_connector_key_but_the_vllm_only_ones() -> None:
    source = _source("sglang_hicache")
    # chunk_tokens: read as BackendSettings.chunk_tokens_given; hash_scheme: always "sglang".
    exempt = {"store", "config_file", "chunk_tokens", "hash_scheme"} | set(VLLM_ONLY_KEYS)
    assert _unread(ConnectorConfig, source, exempt) == []
    assert _unread(SglangOnlySettings, source, set()) == []
    assert VLLM_ONLY_KEYS <= set(ConnectorConfig.__struct_fields__)
    # A vLLM-only key that SGLang starts to read must leave VLLM_ONLY_KEYS (and the docs' list).
    assert [k for k in sorted(VLLM_ONLY_KEYS) if re.search(rf"\.{k}\b", source)] == []


def test_the_sglang_backend_logs_the_keys_it_ignores(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="sglang_hicache.config"):
        load_backend_settings({"lease_ttl_s": 5, "io_workers": 3, "staging_bytes": "8MiB"}, environ={})
    assert "io_workers, lease_ttl_s only read by the vLLM connector" in caplog.text
