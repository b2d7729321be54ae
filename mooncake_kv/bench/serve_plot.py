"""The PNG of ``mooncake-kv bench serve``: hit ratio and TTFT over the run, one line per configuration.

Top: the hit ratio so far (cached prompt tokens over prompt tokens, cumulative in arrival order),
with the trace's ceiling (an infinite cache) for the same requests. Bottom: TTFT per request, as a
rolling median over ``window`` requests so the tiers' effect is not lost in the noise of a shared
machine. Called once at the end of a run, on the caller's thread; writes only ``path``.
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


def write_plot(path: Path, runs: Mapping[str, Sequence[Mapping]], max_hit_tokens: Sequence[int],
               prompt_tokens: Sequence[int], *, title: str, window: int = 15) -> Path:
    """Write the figure to ``path`` (parents created) and return it.

    ``runs``: configuration name -> its per-request records in arrival order, each with
    ``cached_tokens``, ``prompt_tokens`` and ``ttft_s``. ``max_hit_tokens``/``prompt_tokens``: the
    trace's ceiling per request, same order.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
