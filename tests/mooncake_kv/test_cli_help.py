"""``mooncake-kv SUBCOMMAND --help`` shows that subcommand's own options; the console script is
the one in pyproject.toml; choosing a subcommand imports only its own module."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_kv.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "expected"), [
    (["inspect", "--help"], "--verify"),
    (["demo", "--help"], "--trace"),
    (["replay", "--help"], "traces"),
    (["bench", "store", "--help"], "--batch-bytes"),
    (["bench", "vllm", "--help"], "--prompt-tokens"),
    (["bench", "sglang", "--help"], "--layout"),
    (["bench", "--help"], "store"),
    (["--help"], "inspect"),
])
def test_help_lists_the_subcommands_options(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert expected in capsys.readouterr().out


def test_console_script_is_the_cli() -> None:
    scripts = re.search(r"^\[project\.scripts\]\n(.*?)(?:^\[|\Z)", (ROOT / "pyproject.toml").read_text(),
                        re.MULTILINE | re.DOTALL)
    assert scripts is not None, "pyproject.toml has no [project.scripts]"
    target = re.search(r'^mooncake-kv = "([\w.]+):(\w+)"$', scripts.group(1), re.MULTILINE)
    assert target is not None, scripts.group(1)
    assert getattr(importlib.import_module(target.group(1)), target.group(2)) is main


@pytest.mark.parametrize("argv", [["demo", "--help"], ["inspect", "--help"], ["replay", "--help"],
                                  ["bench", "vllm", "--help"], ["bench", "sglang", "--help"]])
def test_help_imports_no_engine(argv: list[str]) -> None:
    """The CLI and a subcommand's arguments load without vLLM, SGLang or torch (a fresh process)."""
    code = ("import sys\nfrom mooncake_kv.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n"
            "    pass\nprint(sorted(m for m in ('torch', 'vllm', 'sglang') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
