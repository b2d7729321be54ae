"""KV layouts and which prefill and decode instances the router may pair (pure): the layout the
connector computes from its fingerprints, the gauge's labels read back, and the check over
equal layouts, different TP sizes, another model and unknown layouts. The router around it is
in tests/mooncake_kv/test_route_pd.py; the gauge of a real engine in
tests/vllm_plugin/test_e2e_pool_disagg.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from mooncake_connector.keys import ModelFingerprint
from mooncake_connector.kv_layout import LAYOUT_INFO, LAYOUT_LABELS, KVLayout, kv_layout, layout_digest
from mooncake_kv.route.decide import DecodeInstance, PDPlan, plan_pd
from mooncake_kv.route.layouts import mismatches, refusal, unpairable
from mooncake_kv.route.server import kv_layout_of


def shards(tp: int, *, model: str = "llama", heads: int = 8, mla: bool = False, epoch: int = 0,
           pp: int = 1) -> list[ModelFingerprint]:
    """Every shard's fingerprint of a ``tp`` x ``pp`` engine, as the connector makes them."""
    out = []
    for shard in range(tp * pp):
        if mla:
            index, count = shard // tp, pp
        else:
            index, count = shard, tp * pp
        out.append(ModelFingerprint(model_id=model, kv_dtype="bfloat16", num_layers=32 // pp,
                                    num_kv_heads=1 if mla else heads // tp, head_size=128, shard_index=index,
                                    shard_count=count, is_mla=mla, epoch=epoch))
    return out


def layout(tp: int, *, pp: int = 1, chunk_tokens: int = 256, **kw: Any) -> KVLayout:
    return kv_layout(shards(tp, pp=pp, **kw), tp_size=tp, pp_size=pp, chunk_tokens=chunk_tokens,
                     hash_scheme="xxh3_128")


def test_the_layout_leaves_out_the_shard_index_and_the_cache_epoch() -> None:
    a = layout(2)
    assert (a.tp_size, a.pp_size, a.kv_heads, a.chunk_tokens) == (2, 1, 4, 256)
    assert layout(2, epoch=7) == a  # another cache epoch: the same layout
    # Every TP rank of one stage names the same layout.
    assert layout_digest(shards(2)[1:]) == layout_digest(shards(2)[:1])
    assert layout(1).fingerprint != a.fingerprint and layout(2, pp=2).fingerprint != a.fingerprint
    with pytest.raises(ValueError, match="at least one"):
        layout_digest([])


def test_equal_layouts_pair() -> None:
    a, b = layout(2), layout(2)
    assert a.differences(b) == []
    assert mismatches({"p": a, "d": b}, {"p": "prefill", "d": "decode"}) == []


def test_different_tp_sizes_do_not_pair_and_the_error_says_why() -> None:
    found = mismatches({"p": layout(2), "d": layout(1)}, {"p": "prefill", "d": "decode"})
    assert [(m.prefill, m.decode, m.differs) for m in found] == [
        ("p", "d", ("TP size 2 vs 1", "KV heads per shard 4 vs 8"))]
    text = refusal(found)
    assert text.startswith("prefill instance 'p' (TP 2) and decode instance 'd' (TP 1) have different KV layouts: "
                           "TP size 2 vs 1, KV heads per shard 4 vs 8. ")
    assert "across different tensor-parallel sizes is not supported (the KV is not re-sharded on load)" in text
    assert unpairable(found, "d") == {"p"} and unpairable(found, "p") == set()


def test_another_model_does_not_pair() -> None:
    a, b = layout(1), layout(1, model="mistral")
    (m,) = mismatches({"p": a, "d": b}, {"p": "prefill", "d": "decode"})
    assert m.differs == (f"model fingerprint {a.fingerprint} vs {b.fingerprint} (another model, weights, KV dtype "
                         f"or layer count)",)
    assert "tensor-parallel" not in refusal([m]) and "same model, weights, KV dtype, chunk_tokens" in refusal([m])
    c = layout(1, chunk_tokens=128)
    assert a.differences(c) == ["chunk_tokens 256 vs 128"]
    assert a.differences(msgspec.structs.replace(a, hash_scheme="sglang")) == ["hash_scheme xxh3_128 vs sglang"]


def test_unknown_layouts_pair_with_any() -> None:
    roles = {"p": "prefill", "d": "decode", "d2": "decode"}
    assert mismatches({"p": None, "d": layout(1), "d2": layout(2)}, roles) == []
    assert mismatches({"p": layout(1)}, roles) == []  # the decode instances not read yet


def test_only_a_prefill_side_and_a_decode_side_are_compared() -> None:
    """Two prefill instances of different layouts never pair with each other anyway; an
    instance of role both is not compared with itself, but with the others on either side."""
    roles = {"p1": "prefill", "p2": "prefill", "b": "both"}
    found = mismatches({"p1": layout(1), "p2": layout(2), "b": layout(2)}, roles)
    assert [(m.prefill, m.decode) for m in found] == [("p1", "b")]
    found = mismatches({"b": layout(2), "d": layout(1)}, {"b": "both", "d": "decode"})
    assert [(m.prefill, m.decode) for m in found] == [("b", "d")]


def test_mla_keys_do_not_depend_on_the_tp_size() -> None:
    """MLA: one latent per pipeline stage, read by every TP rank; the keys, and so the check,
    are the same whatever the TP size."""
    a, b = layout(2, mla=True), layout(1, mla=True)
    assert a.tp_size != b.tp_size and a.differences(b) == []


def test_a_decode_instance_nothing_can_pair_with_takes_the_request_whole() -> None:
    p = 10 * 16 + 1
    assert plan_pd([DecodeInstance("d", True, 0, pairable=False)], p, 16,
                   min_transfer_tokens=16) == PDPlan("d", False, "layout")
    # A short prompt has no prefill leg to pair in the first place.
    assert plan_pd([DecodeInstance("d", True, 0, pairable=False)], 16, 16,
                   min_transfer_tokens=16) == PDPlan("d", False, "short")


def test_the_gauge_is_read_back_from_an_exposition() -> None:
    a = layout(2)
    labels = ",".join(f'{k}="{v}"' for k, v in zip(("model_name", "engine", *LAYOUT_LABELS),
                                                    ("m", "0", *a.label_values())))
    page = f"# TYPE {LAYOUT_INFO} gauge\n{LAYOUT_INFO}{{{labels}}} 1.0\n"
    assert kv_layout_of(page) == a
    assert kv_layout_of("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n") is None
    # A gauge from another version of the connector, with a label missing: not a layout.
    assert kv_layout_of(f'{LAYOUT_INFO}{{tp_size="2"}} 1.0\n') is None
    assert KVLayout.from_labels(dict(zip(LAYOUT_LABELS, a.label_values()))) == a
    assert KVLayout.from_labels({**dict(zip(LAYOUT_LABELS, a.label_values())), "tp_size": "two"}) is None
