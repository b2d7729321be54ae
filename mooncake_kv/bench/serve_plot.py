"""The PNG of ``mooncake-kv bench serve``: hit ratio and TTFT over the run, one line per configuration.

Top: the hit ratio so far (cached prompt tokens over prompt tokens, cumulative in arrival order),
with the trace's ceiling (an infinite cache) for the same requests. Bottom: TTFT per request, as a
rolling median over ``window`` requests so the tiers' effect is not lost in the noise of a shared
machine. With conversation turns (``--sample conversations``) a third panel: TTFT median and hit
ratio per turn of a conversation, the later turns pooled. Called once at the end of a run, on the caller's thread; writes only ``path``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402


def _cumulative(num: Sequence[float], den: Sequence[float]) -> list[float]:
    out, n, d = [], 0.0, 0.0
    for a, b in zip(num, den):
        n, d = n + a, d + b
        out.append(n / d if d else 0.0)
    return out


def _rolling_median(xs: Sequence[float], window: int) -> list[float]:
    return [statistics.median(xs[max(0, i - window + 1):i + 1]) for i in range(len(xs))]


def _turn_key(turn: int, last_turn: int) -> int:
    return min(turn, last_turn)


def write_plot(path: Path, runs: Mapping[str, Sequence[Mapping]], max_hit_tokens: Sequence[int],
               prompt_tokens: Sequence[int], *, title: str, window: int = 15,
               turns: Sequence[int] | None = None, last_turn: int = 8) -> Path:
    """Write the figure to ``path`` (parents created) and return it.

    ``runs``: configuration name -> its per-request records in arrival order, each with
    ``cached_tokens``, ``prompt_tokens`` and ``ttft_s``. ``max_hit_tokens``/``prompt_tokens``: the
    trace's ceiling per request, same order. ``turns``: each request's turn in its conversation
    (1 = first; 0 or None: no turns, two panels only); turns from ``last_turn`` on are pooled.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    per_turn = bool(turns) and any(t > 0 for t in turns)
    if per_turn:
        fig = plt.figure(figsize=(9, 10))
        grid = fig.add_gridspec(3, 1, height_ratios=[1, 1, 1])
        ax_hit = fig.add_subplot(grid[0])
        ax_ttft = fig.add_subplot(grid[1], sharex=ax_hit)
        ax_turn = fig.add_subplot(grid[2])
    else:
        fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    x = list(range(1, len(prompt_tokens) + 1))
    ax_hit.plot(x, _cumulative(max_hit_tokens, prompt_tokens), "k:", lw=2.5, zorder=5,
                label="trace maximum (infinite cache)")
    for name, recs in runs.items():
        ax_hit.plot(x[:len(recs)], _cumulative([r["cached_tokens"] for r in recs], [r["prompt_tokens"] for r in recs]),
                    label=name)
        ax_ttft.plot(x[:len(recs)], _rolling_median([r["ttft_s"] for r in recs], window), label=name)
    ax_hit.set_ylabel("hit ratio so far (cached / prompt tokens)")
    ax_hit.set_ylim(bottom=0)
    ax_hit.legend(loc="lower right", fontsize=8)
    ax_hit.grid(alpha=0.3)
    ax_ttft.set_ylabel(f"TTFT, rolling median of {window} (s)")
    ax_ttft.set_xlabel("request (arrival order)")
    ax_ttft.set_ylim(bottom=0)
    ax_ttft.legend(loc="upper left", fontsize=8)
    ax_ttft.grid(alpha=0.3)
    if per_turn:
        keys = sorted({_turn_key(t, last_turn) for t in turns if t > 0})
        ax_hr = ax_turn.twinx()
        for name, recs in runs.items():
            ttft_k, hit_k = [], []
            for k in keys:
                g = [r for r, t in zip(recs, turns) if t > 0 and _turn_key(t, last_turn) == k]
                ttft_k.append(statistics.median(r["ttft_s"] for r in g))
                hit_k.append(sum(r["cached_tokens"] for r in g) / max(1, sum(r["prompt_tokens"] for r in g)))
            line, = ax_turn.plot(keys, ttft_k, "o-", label=f"{name}: TTFT p50")
            ax_hr.plot(keys, hit_k, "s--", color=line.get_color(), alpha=0.6, label=f"{name}: hit ratio")
        cap = []
        for k in keys:
            idx = [i for i, t in enumerate(turns) if t > 0 and _turn_key(t, last_turn) == k]
            cap.append(sum(max_hit_tokens[i] for i in idx) / max(1, sum(prompt_tokens[i] for i in idx)))
        ax_hr.plot(keys, cap, "k:", lw=2.5, label="trace maximum: hit ratio")
        ax_turn.set_xticks(keys, [str(k) if k < last_turn else f"{k}+" for k in keys])
        ax_turn.set_xlabel("turn of the conversation")
        ax_turn.set_ylabel("TTFT p50 (s), solid")
        ax_turn.set_ylim(bottom=0)
        ax_hr.set_ylabel("hit ratio, dashed")
        ax_hr.set_ylim(0, 1)
        ax_turn.legend(loc="upper left", fontsize=7)
        ax_hr.legend(loc="lower right", fontsize=7)
        ax_turn.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
