"""TieredStore is a KVStore: every method of the Protocol exists on it with a compatible signature.

``isinstance`` against a runtime-checkable Protocol only checks that the names exist; this checks
parameters too (names, kinds, defaults, annotations), so renaming a method or a parameter on either
side fails here rather than in a plugin at run time.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import pytest

from mooncake_connector import client as connector_client
from store_backend import api, store
from store_backend.api import KVStore, StoreClosedError
from store_backend.store import TieredStore


def protocol_methods(proto: type) -> list[str]:
    return sorted(n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_"))


def _norm(annotation: object) -> str:
    return "".join(str(annotation).split())


def incompatibilities(proto: type, impl: type) -> list[str]:
    """Why ``impl`` does not implement ``proto``'s methods as declared (empty: it does).

    A method must exist and accept every call the Protocol allows: the Protocol's parameters, in
    order, with the same names, kinds, defaults and annotations; ``impl`` may add parameters only
    when they have defaults (or are ``*args``/``**kwargs``)."""
    problems: list[str] = []
    for name in protocol_methods(proto):
        got = getattr(impl, name, None)
        if not callable(got):
            problems.append(f"{impl.__name__}.{name} is missing")
            continue
        want_sig = inspect.signature(getattr(proto, name))
        got_sig = inspect.signature(got)
        want = list(want_sig.parameters.values())
        have = list(got_sig.parameters.values())
        for i, w in enumerate(want):
            if i >= len(have):
                problems.append(f"{impl.__name__}.{name} lacks parameter {w.name!r}")
                break
            h = have[i]
            if (h.name, h.kind, h.default) != (w.name, w.kind, w.default):
                problems.append(f"{impl.__name__}.{name} parameter {i}: {h} where the Protocol has {w}")
            elif _norm(h.annotation) != _norm(w.annotation):
                problems.append(f"{impl.__name__}.{name}({w.name}) is annotated {h.annotation!r}, "
                                f"the Protocol {w.annotation!r}")
        for h in have[len(want):]:
            if h.default is inspect.Parameter.empty and h.kind not in (h.VAR_POSITIONAL, h.VAR_KEYWORD):
                problems.append(f"{impl.__name__}.{name} requires the extra parameter {h.name!r}")
        if _norm(got_sig.return_annotation) != _norm(want_sig.return_annotation):
            problems.append(f"{impl.__name__}.{name} returns {got_sig.return_annotation!r}, "
                            f"the Protocol {want_sig.return_annotation!r}")
    return problems


def test_the_protocol_holds_what_the_plugins_call() -> None:
    assert protocol_methods(KVStore) == sorted([
        "put", "get_into", "contains", "exists", "tier_of", "size_of", "keys", "remove", "pin", "unpin",
        "flush", "flush_report", "stats", "metrics", "note_stuck_threads", "note_worker_error", "close",
        "exists_all", "reserve", "commit", "abort", "lease", "release", "reclaim", "host_mapping",
    ])


def test_tiered_store_implements_every_protocol_method_with_its_signature() -> None:
    assert incompatibilities(KVStore, TieredStore) == []
    assert issubclass(TieredStore, KVStore)


class _Renamed:
    """TieredStore with one method renamed and one parameter renamed: the check must see both."""

    def put(self, keys: Sequence[str], buffers: Sequence[object], parent_keys: object = None) -> list:
        return []

    def get_into_buffers(self, keys: Sequence[str], buffers: Sequence[object]) -> list:
        return []


@pytest.mark.parametrize("method", ["get_into", "put"])
def test_the_signature_check_catches_a_renamed_method_or_parameter(method: str) -> None:
    problems = incompatibilities(KVStore, _Renamed)
    assert any(p.startswith(f"_Renamed.{method} ") for p in problems), problems
    missing = type("MissingTierOf", (TieredStore,), {"tier_of": None})
    assert "MissingTierOf.tier_of is missing" in incompatibilities(KVStore, missing)
    assert not isinstance(missing.__new__(missing), KVStore)  # runtime isinstance sees it too


def test_one_store_closed_error_and_one_protocol_wherever_they_are_imported_from() -> None:
    assert store.StoreClosedError is StoreClosedError is api.StoreClosedError
    assert connector_client.KVStore is KVStore
