"""``mooncake-kv replay``: replay request traces through the store and report prefix hit ratios.

Wired into ``mooncake_kv/cli.py``, which calls :func:`add_arguments` and :func:`run`
(also exported as :func:`add_replay_arguments` and :func:`run_replay`). Progress goes to stderr;
the table and, with ``--json``, the summary (as the last line) go to stdout. Writes the plot and
the summary under ``--out``.

Example::

    mooncake-kv replay traces/conversation_trace.jsonl traces/synthetic_trace.jsonl \\
        --policies lru,fifo,prefix_lru --ssd-dram 1M,3M,10M --ssd-policies lru --jobs 2 --json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from store_backend.config import DramConfig
from store_backend.policies.registry import policy_names
from mooncake_kv.replay.experiment import ExperimentSpec, Progress, RunResult, run_experiment
from mooncake_kv.replay.report import TABLE_HEADER, parse_tokens, plot, summarize, table_rows

logger = logging.getLogger(__name__)

_PROGRESS_EVERY = 200  # requests between progress updates


def _token_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(parse_tokens(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the replay options to ``parser`` (the ``replay`` subcommand's parser)."""
    parser.add_argument("traces", nargs="+", help="trace files (jsonl): Mooncake FAST'25 or Qwen-Bailian")
    parser.add_argument("--format", dest="trace_format", choices=["auto", "mooncake", "bailian"], default="auto",
                        help="trace format (default: detected from the first line)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per hash id (default: 512 for Mooncake, 16 for Bailian traces)")
    parser.add_argument("--capacities", type=_token_list, default=(1_000_000, 3_000_000, 10_000_000),
                        help="DRAM capacities in tokens, comma-separated (default: 1M,3M,10M)")
    parser.add_argument("--policy", default=None,
                        help="the policy reported as default_policy (default: the config default, "
                             f"{DramConfig().eviction_policy!r})")
    parser.add_argument("--policies", type=_name_list, default=("lru", "fifo"),
                        help="other policies to compare, comma-separated (lru is always run; "
                             "default: lru,fifo)")
    parser.add_argument("--ssd-tokens", type=parse_tokens, default=50_000_000,
                        help="SSD tier size in tokens for the DRAM+SSD runs (default: 50M; 0 = none)")
    parser.add_argument("--ssd-dram", type=_token_list, default=(3_000_000,),
                        help="DRAM capacities replayed with the SSD tier behind (default: 3M)")
    parser.add_argument("--ssd-policies", type=_name_list, default=(),
                        help="policies also replayed with the SSD tier (the default policy always is)")
    parser.add_argument("--ssd-backend", choices=["offset", "file"], default="offset",
                        help="SSD backend for the DRAM+SSD runs (default: offset)")
    parser.add_argument("--ssd-dir", default=None,
                        help="where the SSD tier's temporary directory goes (default: /dev/shm when writable)")
    parser.add_argument("--engine", choices=["store", "sim"], default="store",
                        help="store: the real TieredStore (default); sim: in-memory stand-in, DRAM only")
    parser.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--bytes-per-token", type=int, default=1, help="payload bytes per token (default: 1)")
    parser.add_argument("--jobs", type=int, default=1, help="replays run in parallel processes (default: 1)")
    parser.add_argument("--out", default="out/replay",
                        help="directory for hit_ratio.png and summary.json (default: out/replay)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line, last")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")


add_replay_arguments = add_arguments


class _RichProgress(Progress):
    def __init__(self, bar: RichProgress, console: Console) -> None:
        self._bar = bar
        self._console = console
        self._tasks: dict[str, int] = {}

    def start_run(self, label: str, total_requests: int) -> Callable[[int], None]:
        task = self._bar.add_task(label, total=total_requests)
        self._tasks[label] = task

        def advance(done: int) -> None:
            if done % _PROGRESS_EVERY == 0 or done == total_requests:
                self._bar.update(task, completed=done)

        return advance

    def end_run(self, label: str, result: RunResult) -> None:
        task = self._tasks.pop(label, None)
        if task is not None:
            self._bar.update(task, completed=result.requests, visible=False)
        tiers = f" (DRAM {result.dram_hit_ratio:.4f}, SSD {result.ssd_hit_ratio:.4f})" if result.ssd_tokens else ""
        self._console.log(f"{label}: hit ratio {result.hit_ratio:.4f}{tiers} in {result.seconds:.1f} s")

    def note(self, text: str) -> None:
        self._console.log(text)


def _spec(args: argparse.Namespace) -> ExperimentSpec:
    default_policy = args.policy or DramConfig().eviction_policy
    known = set(policy_names())
    for name in (default_policy, *args.policies, *args.ssd_policies):
        if name not in known:
            raise SystemExit(f"mooncake-kv replay: unknown policy {name!r}; known: {sorted(known)}")
    for path in args.traces:
        if not Path(path).is_file():
            raise SystemExit(f"mooncake-kv replay: no such trace file: {path}")
    return ExperimentSpec(
        traces=tuple(args.traces), default_policy=default_policy, capacities_tokens=args.capacities,
        policies=args.policies, ssd_tokens=args.ssd_tokens if args.engine == "store" else 0,
        ssd_dram_tokens=args.ssd_dram, ssd_policies=args.ssd_policies, ssd_backend=args.ssd_backend,
        ssd_root=args.ssd_dir, engine=args.engine, trace_format=args.trace_format,
        block_tokens=args.block_tokens, max_requests=args.max_requests,
        bytes_per_token=args.bytes_per_token, jobs=max(1, args.jobs),
    )


def run(args: argparse.Namespace) -> int:
    """Run the experiment, print the table (and the JSON line), write the plot and summary."""
    spec = _spec(args)
    err = Console(stderr=True)
    bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=err, disable=args.no_progress)
    with bar:
        results = run_experiment(spec, None if args.no_progress else _RichProgress(bar, err))
    summary = summarize(results, spec.default_policy, spec.engine)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not args.no_plot:
        png = plot(results, spec.default_policy, out_dir / "hit_ratio.png")
        err.log(f"plot written to {png}")
    table = Table(*TABLE_HEADER, title="prefix hit ratio (hit tokens / input tokens)")
    for row in table_rows(results, spec.default_policy):
        table.add_row(*row)
    Console(file=sys.stdout, width=140).print(table)
    if args.json:
        print(json.dumps(summary, separators=(",", ":")), flush=True)
    return 0


run_replay = run
