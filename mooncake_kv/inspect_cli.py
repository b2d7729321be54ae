"""``mooncake-kv inspect DIR``: print what an SSD tier directory holds (a table, or ``--json``).

The work is :func:`store_backend.ssd.inspect.inspect_directory`; this module parses arguments,
draws the ``--verify`` progress bar (rich, on stderr) and prints the report. Exit status: 0 when
nothing is damaged or unreadable, 1 when something is, 2 when the directory cannot be inspected
(missing, ambiguous, or in use without ``--force``).
"""

from __future__ import annotations

import argparse
import sys

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from store_backend.ssd.inspect import BACKENDS, InspectError, InspectReport, inspect_directory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="the SSD tier directory (ssd.path)")
    p.add_argument("--verify", action="store_true",
                   help="read every stored record and check its checksum (lists the damaged ones)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--force", action="store_true",
                   help="read a directory a running store holds (read-only; results may be inconsistent)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="the backend that wrote the directory (default: detected from its files)")


def run(args: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        if args.verify:
            with Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                          console=err, transient=True) as bar:
                task = bar.add_task("verify", total=None)

                def progress(done: int, total: int) -> None:
                    bar.update(task, completed=done, total=total)

                report = inspect_directory(args.dir, verify=True, force=args.force, backend=args.backend,
                                           on_progress=progress)
        else:
            report = inspect_directory(args.dir, force=args.force, backend=args.backend)
    except InspectError as e:
        print(f"mooncake-kv inspect: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        _print_table(report, Console())
    return 0 if report.healthy else 1


def _size(n: int | None) -> str:
    if n is None:
        return "not recorded"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} B)"
    return f"{n} B"


def _print_table(r: InspectReport, out: Console) -> None:
    t = Table(title=f"SSD directory {escape(r.path)}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("backend", r.backend or "none (no backend's files here)")
    t.add_row("objects", str(r.objects))
    t.add_row("value bytes", _size(r.value_bytes))
    t.add_row("record bytes", _size(r.record_bytes))
    t.add_row("dead records", str(r.dead_records))
    t.add_row("files", str(r.files))
    t.add_row("bytes on disk", f"{_size(r.file_bytes)}; allocated {_size(r.allocated_bytes)}")
    t.add_row("capacity", _size(r.capacity_bytes))
    t.add_row("unreadable", str(len(r.unreadable)))
    t.add_row("open would delete", str(len(r.pending_cleanup)))
    if r.backend == "bucket":
        t.add_row("damaged footers", str(len(r.footer_damaged)))
    t.add_row("verified", f"{r.verified_objects} of {r.objects} records" if r.verified else "no (--verify)")
    t.add_row("damaged", str(len(r.damaged)))
    if r.in_use_by or not r.consistent:
        t.add_row("in use by", ", ".join(f"pid {p}" for p in r.in_use_by) or "pid unknown")
    out.print(t)
    for n in r.unreadable:
        out.print(f"[red]unreadable[/red] {escape(n.file)}: {escape(n.reason)}", highlight=False)
    for d in r.damaged:
        out.print(f"[red]damaged[/red] {escape(d.file)} @ {d.offset} key={escape(repr(d.key))}: {escape(d.reason)}",
                  highlight=False)
    for n in r.pending_cleanup:
        out.print(f"cleanup {escape(n.file)}: {escape(n.reason)}", highlight=False)
    for f in r.footer_damaged:
        out.print(f"[yellow]footer damaged[/yellow] {escape(f)} (records found by scanning)", highlight=False)
    for note in r.notes:
        out.print(f"[yellow]note[/yellow] {escape(note)}", highlight=False)
