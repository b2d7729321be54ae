"""An engine's KV layout: what must be equal for one engine to load the KV chunks another stored.

The vLLM connector's scheduler computes it once from its fingerprints (:func:`kv_layout`) and
publishes it as an info gauge (:data:`LAYOUT_INFO`, value 1, the layout in its labels) in the
engine's ``/metrics``; ``mooncake-kv route`` reads it back (:meth:`KVLayout.from_labels`) and never
pairs a prefill instance with a decode instance whose layout differs (:meth:`KVLayout.differences`).
Pure; any thread; no engine imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import xxhash

from mooncake_connector.keys import ModelFingerprint

LAYOUT_INFO = "mooncake_kv_connector_layout_info"
# The gauge's own labels (an engine's labels, e.g. vLLM's model_name and engine, come before them).
LAYOUT_LABELS = ("tp_size", "pp_size", "kv_heads", "chunk_tokens", "hash_scheme", "fingerprint")


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's KV layout. ``fingerprint``: :func:`layout_digest` of its shards' fingerprints
    (model, weights, config, KV dtype, layers, KV heads and head size per shard, shard count, MLA,
    draft), the part of every chunk key that is neither the shard index nor the cache epoch.
    ``tp_size``, ``pp_size`` and ``kv_heads`` (per shard) are what an operator sets and reads; the
    keys depend on them through ``fingerprint`` (MLA: one latent per pipeline stage, whatever the
    TP size)."""

    tp_size: int
    pp_size: int
    kv_heads: int
    chunk_tokens: int
    hash_scheme: str
    fingerprint: str

    def label_values(self) -> tuple[str, ...]:
        """The values of :data:`LAYOUT_LABELS`, in their order."""
        return tuple(str(getattr(self, name)) for name in LAYOUT_LABELS)

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> KVLayout | None:
        """The layout a sample's labels name (other labels ignored); None when one is missing or
        not of its type (a gauge from another version of the connector)."""
        try:
            return cls(tp_size=int(labels["tp_size"]), pp_size=int(labels["pp_size"]),
                       kv_heads=int(labels["kv_heads"]), chunk_tokens=int(labels["chunk_tokens"]),
                       hash_scheme=labels["hash_scheme"], fingerprint=labels["fingerprint"])
        except (KeyError, ValueError):
            return None

    def differences(self, other: KVLayout) -> list[str]:
        """What keeps ``other`` from loading chunks this layout stored (and the other way round),
        one phrase each, this layout's value first: the TP size, the PP size and the KV heads per
        shard where the fingerprints differ, the fingerprints themselves when none of those does
        (another model, weights, KV dtype or layer count), ``chunk_tokens`` and the hash scheme.
        Empty: the chunk keys match."""
        out: list[str] = []
        if self.fingerprint != other.fingerprint:
            for name, what in (("tp_size", "TP size"), ("pp_size", "PP size"), ("kv_heads", "KV heads per shard")):
                if getattr(self, name) != getattr(other, name):
                    out.append(f"{what} {getattr(self, name)} vs {getattr(other, name)}")
            if not out:
                out.append(f"model fingerprint {self.fingerprint} vs {other.fingerprint} "
                           f"(another model, weights, KV dtype or layer count)")
        if self.chunk_tokens != other.chunk_tokens:
            out.append(f"chunk_tokens {self.chunk_tokens} vs {other.chunk_tokens}")
        if self.hash_scheme != other.hash_scheme:
            out.append(f"hash_scheme {self.hash_scheme} vs {other.hash_scheme}")
        return out


def layout_digest(fingerprints: Sequence[ModelFingerprint]) -> str:
    """16 hex chars naming what every shard's chunk keys depend on, besides the shard index and
    the cache epoch: each shard's fingerprint with those two set to 0, in shard order, repeats
    dropped (the TP ranks of one pipeline stage differ only in their index)."""
    if not fingerprints:
        raise ValueError("layout_digest needs at least one shard's fingerprint")
    seen: list[str] = []
    for fp in fingerprints:
        d = msgspec.structs.replace(fp, shard_index=0, epoch=0).digest()
        if d not in seen:
            seen.append(d)
    return xxhash.xxh3_64_hexdigest("/".join(seen).encode("ascii"))


def kv_layout(fingerprints: Sequence[ModelFingerprint], *, tp_size: int, pp_size: int, chunk_tokens: int,
              hash_scheme: str) -> KVLayout:
    """The layout of an engine whose shards have ``fingerprints`` (shard 0 first)."""
    return KVLayout(tp_size=tp_size, pp_size=pp_size, kv_heads=fingerprints[0].num_kv_heads if fingerprints else 0,
                    chunk_tokens=chunk_tokens, hash_scheme=hash_scheme, fingerprint=layout_digest(fingerprints))
