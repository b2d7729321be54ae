"""What ``mooncake-kv bench serve`` makes of a run: the server's metrics scraped and parsed, hits
attributed to their source, TTFT summaries (overall, per turn), token comparisons against the
baseline, load failures from the server's log, and the break-even load bandwidth."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


SOURCES = ("device", "host", "disk", "p2p", "external_unspecified")


def break_even(kv_bytes: int, prefill: dict[str, Any] | None) -> dict[str, Any]:
    """``kv_bytes_per_token``, ``prefill_s_per_token`` and ``break_even_load_gbps`` (GB/s, 1e9
    bytes: the read bandwidth at which loading a token's KV takes as long as computing it)."""
    per_token = prefill.get("s_per_token") if prefill else None
    if not per_token:
        return {"kv_bytes_per_token": kv_bytes, "prefill_s_per_token": None, "break_even_load_gbps": None}
    per_token = float(f"{per_token:.4g}")  # four significant digits, the break-even computed from them
    return {"kv_bytes_per_token": kv_bytes, "prefill_s_per_token": per_token,
            "break_even_load_gbps": float(f"{kv_bytes / per_token / 1e9:.4g}")}


# -- the client ------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """``source:NAME`` -> tokens of vLLM's by-source counter, ``tier_hits:TIER`` -> objects the
    store's gets served from that tier, ``stage_ins`` -> leases served by reading SSD into a slot."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == BY_SOURCE:
                key = "source:" + s.labels.get("source", "?")
            elif s.name == "mooncake_kv_tier_hits_total":
                key = "tier_hits:" + s.labels.get("tier", "?")
            elif s.name == "mooncake_kv_store_slot_stage_ins_total":
                key = "stage_ins"
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


class _Scraper:
    """Deltas of the cache counters between consecutive scrapes, one scrape at a time (asyncio)."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client, self._url = client, url
        self._lock = asyncio.Lock()
        self.last: dict[str, float] = {}

    async def delta(self) -> dict[str, float]:
        async with self._lock:
            now = parse_metrics((await self._client.get(self._url + "/metrics")).text)
            d = {k: v - self.last.get(k, 0.0) for k, v in now.items() if v - self.last.get(k, 0.0)}
            self.last = now
            return d


# -- summary ---------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def attribute_sources(recs: list[dict], totals: dict[str, float]) -> None:
    """Set each record's ``tier_tokens`` (source -> tokens): the by-source counter deltas, in the
    order they were scraped, consumed by the requests in arrival order, each taking its
    ``cached_tokens``. vLLM counts a request's hits when it admits it and admits in arrival order,
    so this is exact when no two requests' counts fall into one scrape; when they do, the split
    between those requests follows the order of the sources in the delta."""
    queue: list[list] = []  # [source, tokens left]
    seen: dict[str, int] = {}
    for r in sorted(recs, key=lambda r: r.get("scraped_s", 0.0)):
        for src, n in r.get("source_delta", {}).items():
            queue.append([src, n])
            seen[src] = seen.get(src, 0) + n
    for key, v in totals.items():  # what the engine published after the last request's scrape
        if key.startswith("source:") and int(v) > seen.get(key[7:], 0):
            queue.append([key[7:], int(v) - seen.get(key[7:], 0)])
    pos = 0
    for r in sorted(recs, key=lambda r: r["index"]):
        want, got = r["cached_tokens"], {}
        while want > 0 and pos < len(queue):
            take = min(want, queue[pos][1])
            if take > 0:
                got[queue[pos][0]] = got.get(queue[pos][0], 0) + take
            queue[pos][1] -= take
            want -= take
            if queue[pos][1] <= 0:
                pos += 1
        r["tier_tokens"] = got


def by_turn(recs: list[dict], last_turn: int = 8) -> dict[str, dict[str, float]]:
    """Turn ("1".."last_turn", and f"{last_turn}+" for the later ones pooled) -> requests, TTFT
    p50 and hit ratio; empty when the records carry no turns (``--sample time``)."""
    groups: dict[str, list[dict]] = {}
    for r in recs:
        if r.get("turn", 0) > 0:
            groups.setdefault(str(r["turn"]) if r["turn"] < last_turn else f"{last_turn}+", []).append(r)
    out = {}
    for key in sorted(groups, key=lambda k: int(k.rstrip("+"))):
        g = groups[key]
        prompt = sum(r["prompt_tokens"] for r in g)
        out[key] = {"requests": len(g), "ttft_p50_s": round(_pct([r["ttft_s"] for r in g], 50), 4),
                    "hit_ratio": round(sum(r["cached_tokens"] for r in g) / prompt, 4) if prompt else 0.0,
                    "hit_ratio_max": round(sum(r["max_hit_tokens"] for r in g) / prompt, 4) if prompt else 0.0}
    return out


def summarize(recs: list[dict], wall_s: float, totals: dict[str, float]) -> dict[str, Any]:
    """One configuration's figures. ``ttft_p50_reusable_s``: the TTFT p50 of the requests at least
    half of whose prompt could be reused (``max_hit_tokens`` at least half ``prompt_tokens``), the
    ones a KV store can speed up (None when there are none)."""
    ttft = [r["ttft_s"] for r in recs]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    reusable = [r["ttft_s"] for r in recs if 2 * r["max_hit_tokens"] >= r["prompt_tokens"] > 0]
    return {"by_turn": by_turn(recs),"ttft_p50_s": round(_pct(ttft, 50), 4), "ttft_p90_s": round(_pct(ttft, 90), 4),
            "reusable_requests": len(reusable),
            "ttft_p50_reusable_s": round(_pct(reusable, 50), 4) if reusable else None,
            "ttft_p99_s": round(_pct(ttft, 99), 4), "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
            "throughput_req_s": round(len(recs) / wall_s, 3), "prompt_tokens_s": round(prompt / wall_s, 1),
            "wall_s": round(wall_s, 2), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
            "cached_by_source": {s: int(totals.get("source:" + s, 0)) for s in SOURCES if totals.get("source:" + s)},
            "store_hits_objects": {k.split(":", 1)[1]: int(v) for k, v in totals.items() if k.startswith("tier_hits:")},
            # Leases of SSD objects read into a DRAM slot first (then counted as DRAM hits by the store).
            "store_stage_ins": int(totals.get("stage_ins", 0)),
            # Chunk loads that failed and vLLM recomputed (from the server's log).
            "load_failures": {k.split(":", 1)[1]: int(v) for k, v in totals.items() if k.startswith("load_failures:")}}


def compare_tokens(base: list[dict], other: list[dict], every: int) -> list[int]:
    """Indices of the checked requests (every ``every``-th) whose generated tokens differ."""
    return [a["index"] for a, b in zip(base, other) if a["index"] % every == 0 and a["tokens"] != b["tokens"]]


_RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled \((\d+) tokens affected\)")


def load_failures(log_text: str) -> dict[str, int]:
    """The loads vLLM recomputed (policy ``recompute``), from its server log: ``events``, the
    ``requests`` rescheduled and the ``tokens`` affected, summed."""
    found = [(int(m.group(1)), int(m.group(2))) for m in _RECOVERED.finditer(log_text)]
    return {"events": len(found), "requests": sum(r for r, _ in found), "tokens": sum(t for _, t in found)}
