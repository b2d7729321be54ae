"""Turning replay results into the JSON summary, a text table and the PNG plot.

Pure functions over :class:`~mooncake_kv.replay.experiment.TraceResult` lists; the plot uses
matplotlib's Agg canvas (no display needed; matplotlib is imported only when a plot is drawn,
as it is an optional dependency). Called by the CLI on the caller's thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake_kv.replay.experiment import TraceResult
from mooncake_kv.replay.reference import speedup

GAP_CLOSED_TARGET = 0.5
SSD_VS_MAX_TARGET = 0.99
# Capacities (tokens) whose gap_closed the target is checked at; others are reported only.
GAP_TARGET_CAPACITIES = (1_000_000, 3_000_000)


def tokens_label(tokens: int) -> str:
    """1_000_000 -> "1M", 2_500_000 -> "2.5M", 64_000 -> "64K", 1500 -> "1500"."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= scale and tokens % (scale // 10) == 0:
            value = tokens / scale
            return f"{value:g}{unit}"
    return str(tokens)


def parse_tokens(text: str) -> int:
    """ "3M" -> 3_000_000, "64K" -> 64_000, "1.5G", "4096" (decimal units; raises ValueError)."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    number = t[:-1] if scale != 1 else t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (use e.g. 4096, 64K, 3M)") from None
    if value <= 0:
        raise ValueError(f"token count must be > 0, got {text!r}")
    return int(round(value * scale))


def gap_closed(policy: float, lru: float, belady: float) -> float | None:
    """Share of the LRU-to-Belady gap a policy closes; None when there is no gap."""
    gap = belady - lru
    return None if gap <= 1e-12 else (policy - lru) / gap


def ssd_key(dram_tokens: int, ssd_tokens: int) -> str:
    return f"dram{tokens_label(dram_tokens)}_ssd{tokens_label(ssd_tokens)}".lower()


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def summarize(results: list[TraceResult], default_policy: str, engine: str) -> dict[str, Any]:
    """The JSON object ``mooncake-kv replay --json`` prints last (see docs/PERFORMANCE.md)."""
    traces: dict[str, Any] = {}
    gaps: list[float] = []
    vs_max: list[float] = []
    for tr in results:
        entry: dict[str, Any] = {
            "requests": tr.requests, "input_tokens": tr.input_tokens, "block_tokens": tr.block_tokens,
            "max": _r(tr.max_ratio),
        }
        dram_caps = sorted({r.dram_tokens for r in tr.runs if not r.ssd_tokens})
        for cap in dram_caps:
            lru = tr.run("lru", cap)
            pol = tr.run(default_policy, cap)
            bel = tr.belady.get(cap)
            if lru is None or pol is None or bel is None:
                continue
            gc = gap_closed(pol.hit_ratio, lru.hit_ratio, bel)
            oracle = tr.oracle_lru.get(cap)
            lfu = tr.oracle_lfu.get(cap)
            if gc is not None and cap in GAP_TARGET_CAPACITIES:
                gaps.append(gc)
            entry[tokens_label(cap)] = {
                "max": _r(tr.max_ratio), "belady": _r(bel), "lru": _r(lru.hit_ratio),
                "default_policy": _r(pol.hit_ratio), "gap_closed": _r(gc),
                "dead_block_oracle_lru": _r(oracle),
                "dead_block_oracle_lru_gap_closed": _r(None if oracle is None else gap_closed(oracle, lru.hit_ratio, bel)),
                "future_count_oracle_lfu": _r(lfu),
                "future_count_oracle_lfu_gap_closed": _r(None if lfu is None else gap_closed(lfu, lru.hit_ratio, bel)),
                "policies": {r.policy: _r(r.hit_ratio) for r in tr.runs if r.dram_tokens == cap and not r.ssd_tokens},
                "speedup": {"max": _r(speedup(tr.max_ratio)), "belady": _r(speedup(bel)),
                            "lru": _r(lru.speedup), "default_policy": _r(pol.speedup)},
            }
        for r in tr.runs:
            if not r.ssd_tokens or r.policy != default_policy:
                continue
            key = ssd_key(r.dram_tokens, r.ssd_tokens)
            ratio = r.hit_ratio / tr.max_ratio if tr.max_ratio else None
            entry[key] = _r(r.hit_ratio)
            entry[f"{key}_vs_max"] = _r(ratio)
            entry[f"{key}_tiers"] = {"dram": _r(r.dram_hit_ratio), "ssd": _r(r.ssd_hit_ratio),
                                     "speedup": _r(r.speedup)}
            if (r.dram_tokens, r.ssd_tokens) == (3_000_000, 50_000_000) and ratio is not None:
                vs_max.append(ratio)
        traces[tr.name] = entry
    met = bool(gaps) and min(gaps) >= GAP_CLOSED_TARGET and bool(vs_max) and min(vs_max) >= SSD_VS_MAX_TARGET
    return {
        "default_policy": default_policy,
        "engine": engine,
        "traces": traces,
        "targets": {
            "gap_closed_min_1m_3m": _r(min(gaps)) if gaps else None,
            "gap_closed_target": GAP_CLOSED_TARGET,
            "dram3m_ssd50m_vs_max_min": _r(min(vs_max)) if vs_max else None,
            "dram3m_ssd50m_vs_max_target": SSD_VS_MAX_TARGET,
            "met": met,
        },
    }


def table_rows(results: list[TraceResult], default_policy: str) -> list[list[str]]:
    """Rows for a text table: trace, setup, policy, hit ratio (dram/ssd), speed-up, vs max."""
    rows: list[list[str]] = []
    for tr in results:
        rows.append([tr.name, "unbounded", "maximum", f"{tr.max_ratio:.4f}", "", f"{speedup(tr.max_ratio):.2f}x", "1.000"])
        for cap, bel in sorted(tr.belady.items()):
            rows.append([tr.name, f"DRAM {tokens_label(cap)}", "belady", f"{bel:.4f}", "",
                         f"{speedup(bel):.2f}x", f"{bel / tr.max_ratio:.3f}" if tr.max_ratio else ""])
        for cap, orc in sorted(tr.oracle_lru.items()):
            rows.append([tr.name, f"DRAM {tokens_label(cap)}", "LRU + dead-block oracle", f"{orc:.4f}", "",
                         f"{speedup(orc):.2f}x", f"{orc / tr.max_ratio:.3f}" if tr.max_ratio else ""])
        for cap, orc in sorted(tr.oracle_lfu.items()):
            rows.append([tr.name, f"DRAM {tokens_label(cap)}", "LFU + future-count oracle", f"{orc:.4f}", "",
                         f"{speedup(orc):.2f}x", f"{orc / tr.max_ratio:.3f}" if tr.max_ratio else ""])
        for r in tr.runs:
            setup = f"DRAM {tokens_label(r.dram_tokens)}" + (f" + SSD {tokens_label(r.ssd_tokens)}" if r.ssd_tokens else "")
            tiers = f"{r.dram_hit_ratio:.4f} / {r.ssd_hit_ratio:.4f}" if r.ssd_tokens else ""
            name = r.policy + (" (default)" if r.policy == default_policy else "")
            rows.append([tr.name, setup, name, f"{r.hit_ratio:.4f}", tiers, f"{r.speedup:.2f}x",
                         f"{r.hit_ratio / tr.max_ratio:.3f}" if tr.max_ratio else ""])
    return rows


TABLE_HEADER = ["trace", "capacity (tokens)", "policy", "hit ratio", "DRAM / SSD", "speed-up", "vs max"]


def plot(results: list[TraceResult], default_policy: str, path: str | Path) -> Path:
    """Hit ratio vs DRAM capacity per trace: each policy, Belady, maximum; DRAM+SSD as markers."""
    # The object API with the Agg canvas: no pyplot, no process-wide backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.4 * max(1, len(results)), 6.0))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(results)), squeeze=False)
    for ax, tr in zip(axes[0], results):
        caps = sorted(tr.belady)
        ax.axhline(tr.max_ratio, color="black", linestyle=":", label=f"maximum ({tr.max_ratio:.3f})")
        ax.plot(caps, [tr.belady[c] for c in caps], color="black", linestyle="--", marker="o", label="Belady (offline)")
        ax.plot(caps, [tr.oracle_lru[c] for c in caps], color="gray", linestyle="--", marker=".",
                label="LRU + dead-block oracle (offline)")
        ax.plot(caps, [tr.oracle_lfu[c] for c in caps], color="gray", linestyle=":", marker="x",
                label="LFU + future-count oracle (offline)")
        policies = list(dict.fromkeys(r.policy for r in tr.runs if not r.ssd_tokens))
        for pol in policies:
            pts = sorted((r.dram_tokens, r.hit_ratio) for r in tr.runs if r.policy == pol and not r.ssd_tokens)
            style = {"linewidth": 2.5} if pol == default_policy else {"linewidth": 1.2}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{pol} (DRAM)", **style)
        for pol in dict.fromkeys(r.policy for r in tr.runs if r.ssd_tokens):
            pts = sorted((r.dram_tokens, r.hit_ratio, r.ssd_tokens) for r in tr.runs if r.policy == pol and r.ssd_tokens)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="-.",
                    label=f"{pol} (DRAM + SSD {tokens_label(pts[0][2])})")
        ax.set_xscale("log")
        ax.set_xlabel("DRAM capacity (tokens)")
        ax.set_ylabel("prefix hit ratio (hit tokens / input tokens)")
        ax.set_title(f"{tr.name} ({tr.requests} requests)")
        ax.set_ylim(0, min(1.0, tr.max_ratio * 1.15 + 0.02))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: off the lines
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out
