from __future__ import annotations

import json

import pytest

from store_backend.config import ConfigError, StoreConfig, load_config, parse_size


def test_defaults_and_sizes() -> None:
    cfg = load_config({}, environ={})
    assert isinstance(cfg, StoreConfig) and cfg.ssd is None
    cfg = load_config({"dram": {"capacity_bytes": "64MiB"}, "ssd": {"path": "/tmp/x", "capacity_bytes": "2GB"}},
                      environ={})
    assert cfg.dram.capacity_bytes == 64 << 20
    assert cfg.ssd is not None and cfg.ssd.capacity_bytes == 2 * 10**9
    assert parse_size("4096") == 4096 and parse_size("1KiB") == 1024


def test_file_sources(tmp_path) -> None:
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"dram": {"capacity_bytes": 1 << 20}}))
    assert load_config(j, environ={}).dram.capacity_bytes == 1 << 20
    y = tmp_path / "c.yaml"
    y.write_text("dram:\n  capacity_bytes: 2MiB\noffload:\n  policy: watermark\n")
    cfg = load_config(str(y), environ={})
    assert cfg.dram.capacity_bytes == 2 << 20 and cfg.offload.policy == "watermark"
    cfg = load_config(None, environ={"MOONCAKE_KV_CONFIG": str(y), "MOONCAKE_KV_DRAM__CAPACITY_BYTES": "3MiB"})
    assert cfg.dram.capacity_bytes == 3 << 20


def test_env_overrides() -> None:
    cfg = load_config(None, environ={"MOONCAKE_KV_SSD__PATH": "/tmp/s", "MOONCAKE_KV_SSD__DIRECT_IO": "false",
                                     "MOONCAKE_KV_PROMOTION__ADMISSION_HITS": "3",
                                     "MOONCAKE_KV_VENV": "/opt/venv"})  # a script's variable, not a setting
    assert cfg.ssd is not None and cfg.ssd.path == "/tmp/s" and cfg.ssd.direct_io is False
    assert cfg.promotion.admission_hits == 3


def test_env_typo_in_a_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match="capcity_bytes"):
        load_config(None, environ={"MOONCAKE_KV_DRAM__CAPCITY_BYTES": "1MiB"})


@pytest.mark.parametrize(
    "data, field",
    [
        ({"dram": {"capacity_bytes": -1}}, "capacity_bytes"),
        ({"dram": {"capacity_bytes": "12 parsecs"}}, "dram.capacity_bytes"),
        ({"dram": {"capcity_bytes": 1}}, "capcity_bytes"),
        ({"dram": {"alignment_bytes": 3000}}, "alignment_bytes"),
        ({"dram": {"shm_name": "../etc"}}, "shm_name"),
        ({"offload": {"low_watermark": 0.95}}, "low_watermark"),
        ({"offload": {"policy": "sometimes"}}, "offload"),
        ({"ssd": {"path": "/x", "backend": "tape"}}, "backend"),
        ({"ssd": {"capacity_bytes": 10}}, "path"),
        ({"promotion": {"admission_hits": 0}}, "admission_hits"),
        # Below one alignment unit nothing fits (every put would answer TOO_LARGE).
        ({"dram": {"capacity_bytes": 4095}}, "dram.capacity_bytes: must be at least 4096, got 4095"),
        ({"dram": {"capacity_bytes": 8192, "alignment_bytes": 16384}}, "dram.capacity_bytes: must be at least 16384"),
        ({"ssd": {"path": "/x", "capacity_bytes": 4096}}, "ssd.capacity_bytes: must be at least 16384, got 4096"),
        # Sizes no machine has are typos (and overflow file offsets and mappings).
        ({"dram": {"capacity_bytes": "2000000TiB"}}, "dram.capacity_bytes: must be at most"),
        ({"ssd": {"path": "/x", "capacity_bytes": 1 << 63}}, "ssd.capacity_bytes: must be at most"),
        ({"max_object_bytes": 1 << 61}, "max_object_bytes: must be at most"),
    ],
)
def test_bad_values_name_the_field(data, field) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(data, environ={})
    assert field in str(e.value)


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad, environ={})
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst, environ={})


@pytest.mark.parametrize("field,value", [("put_wait_s", -0.1), ("put_wait_s", 3601), ("write_threads", 0),
                                         ("write_threads", 17)])
def test_offload_waits_and_write_threads_are_bounded(field, value) -> None:
    with pytest.raises(ConfigError, match=f"offload.{field}"):
        load_config({"offload": {field: value}}, environ={})
    cfg = load_config({"offload": {"put_wait_s": 0, "write_threads": 1}}, environ={})
    assert cfg.offload.put_wait_s == 0 and cfg.offload.write_threads == 1
    assert load_config(environ={"MOONCAKE_KV_OFFLOAD__PUT_WAIT_S": "0.25"}).offload.put_wait_s == 0.25
