"""The pre-registered workloads of ``mooncake-kv bench serve --suite``, and the medians it reports.

The suite is fixed here and in docs/PERFORMANCE.md before any of its figures is reported; a change
to a workload, a setting or the configurations gets a new :data:`SUITE_NAME`, and figures of
another name are not compared with it. Each workload runs at two sizes of vLLM's own prefix cache,
the same in every configuration: 256 blocks (8,192 tokens, a cache that holds a few requests) and
``working-set`` (every block the workload sends, so vLLM alone never evicts and the tiers can add
no hit to it).

- ``default``: the workload of the default command (the trace's first 200 requests, time scale 0.5).
- ``window-900``, ``window-1800``, ``window-2700``: every request that arrives within 600 trace
  seconds from 900, 1800 or 2700 s and belongs to one conversation in ten (single requests and
  2-turn conversations included: nothing is chosen by its length or turns), time scale 5 (about
  two requests a second, the default's rate). See ``serve_workload`` for the rule.

Configurations: ``alone`` and ``dram_ssd`` (the default command's ``dram`` is left out to keep a
pass within an hour; ``test_e2e_metrics`` and the default command cover it). Model: the default
seeded model (2 layers, hidden 512, float32). Pure code: it returns the runs' settings and the
medians, the caller runs the servers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUITE_NAME = "serve-suite-1"
SUITE_CONFIGS = "alone,dram_ssd"
SUITE_CACHES: tuple[int | str, ...] = (256, "working-set")
# The figures each workload reports per cache size, as median, min and max over the passes.
SUITE_METRICS = ("ttft_p50_dram_ssd_vs_alone", "ttft_p50_reusable_dram_ssd_vs_alone", "hit_dram_ssd_vs_max",
                 "hit_ratio_alone", "hit_ratio_dram_ssd", "hit_ratio_max", "ttft_p50_s_alone", "ttft_p50_s_dram_ssd")


@dataclass(frozen=True)
class SuiteWorkload:
    """One workload: ``settings`` are the ``bench serve`` options (argparse names) it sets."""

    name: str
    what: str
    settings: dict[str, Any] = field(default_factory=dict)


def _window(start_s: float) -> SuiteWorkload:
    return SuiteWorkload(
        f"window-{start_s:.0f}",
        f"one conversation in 10, every request of it in [{start_s:.0f}, {start_s + 600:.0f}) s, time scale 5",
        {"sample": "window", "start_s": start_s, "window": 600.0, "thin": 10, "time_scale": 5.0, "requests": 400})


SUITE: tuple[SuiteWorkload, ...] = (
    SuiteWorkload("default", "the default command's workload: the trace's first 200 requests, time scale 0.5"),
    _window(900.0),
    _window(1800.0),
    _window(2700.0),
)

# Options a suite run takes from the command line; every other one is the default or the suite's.
_PASSED_THROUGH = ("trace", "model", "reserved_cpus", "work_dir", "port", "json")
# Options of the suite itself.
_SUITE_OPTIONS = ("suite", "repeats", "plot", "suite_summary")


def options_the_suite_sets(args: argparse.Namespace, defaults: argparse.Namespace) -> list[str]:
    """The options given in ``args`` (different from ``defaults``) that a suite run would not use:
    the suite's workloads and settings are its own."""
    return sorted(k for k, v in vars(args).items()
                  if k not in _PASSED_THROUGH + _SUITE_OPTIONS and v != getattr(defaults, k, v))


def suite_runs(args: argparse.Namespace, defaults: argparse.Namespace) -> list[tuple[str, int | str, argparse.Namespace]]:
    """One pass of the suite: (workload, cache size, the options of that run), in run order.
    ``defaults`` is the parser's defaults; a run takes them, then the workload's settings, the
    suite's configurations and cache size, and from ``args`` only the trace, the reserved cores, the
    port and the work directory (the caller sets each run's own work directory and plot)."""
    out = []
    for wl in SUITE:
        for cache in SUITE_CACHES:
            ns = argparse.Namespace(**vars(defaults))
            for k in _PASSED_THROUGH:
                setattr(ns, k, getattr(args, k))
            for k, v in wl.settings.items():
                if not hasattr(ns, k):
                    raise AssertionError(f"suite workload {wl.name}: no option {k!r}")
                setattr(ns, k, v)
            ns.configs, ns.vllm_blocks, ns.suite = SUITE_CONFIGS, cache, False
            out.append((wl.name, cache, ns))
    return out


def _spread(values: list[float]) -> dict[str, float | int] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def suite_summary(records: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    """The suite's one JSON object from its runs' records (``workload``, ``cache``, ``result``: the
    run's JSON object, or ``error``): per workload and cache size, median, min and max over the
    passes of each of :data:`SUITE_METRICS` (a run that failed counts in no median and is listed
    under ``failed_runs``), and every token mismatch."""
    medians: dict[str, dict[str, dict[str, Any]]] = {}
    mismatches: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for wl in SUITE:
        medians[wl.name] = {}
        for cache in SUITE_CACHES:
            mine = [r for r in records if r["workload"] == wl.name and r["cache"] == cache]
            ok = [r["result"] for r in mine if "result" in r]
            failed += [{"workload": wl.name, "cache": cache, "error": r["error"][-500:]} for r in mine if "error" in r]
            for res in ok:
                bad = {n: m for n, m in res.get("token_mismatches", {}).items() if m}
                if bad:
                    mismatches.append({"workload": wl.name, "cache": cache, "mismatches": bad})
            row: dict[str, Any] = {m: _spread([float(r[m]) for r in ok if r.get(m) is not None]) for m in SUITE_METRICS}
            row["vllm_cache_tokens"] = sorted({r["workload"]["vllm_cache_tokens"] for r in ok})
            row["requests"] = sorted({r["workload"]["requests"] for r in ok})
            medians[wl.name][str(cache)] = row
    return {"suite": SUITE_NAME, "workloads": [wl.name for wl in SUITE], "configs": SUITE_CONFIGS,
            "caches": [str(c) for c in SUITE_CACHES], "repeats": repeats, "runs": len(records),
            "failed_runs": failed, "token_mismatches": mismatches, "medians": medians}


def read_suite_runs(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], int]:
    """The records of ``suite-runs.jsonl`` files written by separate ``--suite`` invocations, and
    how many passes they hold (each pass of each file counts once). Raises ValueError naming the
    file and line of a record that is not JSON, lacks ``pass``, ``workload`` or ``cache``, or
    belongs to another suite (its figures are not comparable with this one's)."""
    records: list[dict[str, Any]] = []
    passes: set[tuple[int, int]] = set()
    for i, path in enumerate(paths):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"{path}: cannot read the suite's runs: {e}") from e
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON record: {e}") from e
            if not isinstance(rec, dict) or not {"pass", "workload", "cache"} <= rec.keys():
                raise ValueError(f"{path}:{n}: a suite run record has pass, workload and cache")
            if rec.get("suite") != SUITE_NAME:
                raise ValueError(f"{path}:{n}: a run of suite {rec.get('suite')!r}, not {SUITE_NAME!r}: "
                                 "figures of another suite are not compared with this one's")
            passes.add((i, int(rec["pass"])))
            records.append(rec)
    return records, len(passes)
