"""The command line both reference generators share (``config_reference.py``, ``metrics_reference.py``).

``main(render, script, argv, description)`` prints ``render()`` to stdout, or with ``--check FILE``
exits 1 (naming the command that regenerates it) when FILE differs from it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def main(render: Callable[[], str], script: str, argv: list[str] | None, description: str) -> int:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated text")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if Path(args.check).read_text() != text:
            print(f"{args.check} is out of date: run python scripts/{script} > {args.check}", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0
