"""Imports run one way: the import-linter contracts in ``pyproject.toml`` hold for the tree.

``mooncake_kv`` (application) > ``vllm_plugin`` | ``sglang_hicache`` (independent) >
``mooncake_connector`` > ``store_backend``; the store imports no engine and no torch; dev tools are
imported only by the benchmarks. import-linter reads every import statement, those inside functions
and under ``TYPE_CHECKING`` included.

import-linter comes with the ``test`` extra (``bash scripts/setup.sh all``). Where it is missing the
tests skip, which under CI is a failure (``tests/conftest.py``).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mooncake_kv", "vllm_plugin", "sglang_hicache", "mooncake_connector", "store_backend")


def _lint_imports() -> Path:
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        pytest.skip(f"import-linter is not installed ({exe} missing; pip install 'import-linter>=2')")
    return exe


def _contracts(pyproject: Path) -> int:
    return len(re.findall(r"^\[\[tool\.importlinter\.contracts\]\]$", pyproject.read_text(), re.MULTILINE))


def _run(cwd: Path, config: Path) -> subprocess.CompletedProcess[str]:
    # The packages are found from cwd (lint-imports puts it first on sys.path); PYTHONPATH could
    # point at another tree.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(_lint_imports()), "--no-cache", "--no-logo", str(config)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_package_is_under_the_contracts() -> None:
    """A new top-level package (installed by setuptools) must take its place in the layers."""
    text = (ROOT / "pyproject.toml").read_text()
    roots = re.search(r"^root_packages = \[(.*?)\]$", text, re.MULTILINE)
    include = re.search(r"^\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*?)\]$", text, re.MULTILINE)
    assert roots is not None and include is not None, "pyproject.toml: root_packages or packages.find include missing"
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    installed = {name.rstrip("*") for name in re.findall(r'"([^"]+)"', include.group(1))}
    linted = set(re.findall(r'"([^"]+)"', roots.group(1)))
    assert on_disk == installed == linted == set(PACKAGES), (on_disk, installed, linted)


def test_every_contract_is_kept() -> None:
    n = _contracts(ROOT / "pyproject.toml")
    assert n >= 6, "the import-linter contracts are missing from pyproject.toml"
    proc = _run(ROOT, ROOT / "pyproject.toml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"lint-imports found imports against the layers:\n{out}"
    assert f"Contracts: {n} kept, 0 broken." in out, out


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_examples_import_no_benchmark() -> None:
    """An example is code users copy: what it needs comes from the packages or ``mooncake_kv.devtools``."""
    examples = sorted((ROOT / "examples").rglob("*.py"))
    assert examples, "no example scripts found"
    offending = {str(path.relative_to(ROOT)): sorted(m for m in _imported_modules(path)
                                                     if any(part.startswith("bench") for part in m.split(".")))
                 for path in examples}
    assert {k: v for k, v in offending.items() if v} == {}


def _write(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_an_upward_import_inside_a_function_breaks_the_contracts(tmp_path: Path) -> None:
    """Every contract can fail: a copy of the tree with lazy imports against each of them."""
    _lint_imports()
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "store_backend" / "_upward.py").write_text(
        "def f():\n    from mooncake_connector import keys\n    import torch\n    return keys, torch\n")
    _write(tmp_path / "sglang_hicache" / "__init__.py", "\ndef _f():\n    import vllm_plugin\n    import vllm\n")
    _write(tmp_path / "vllm_plugin" / "__init__.py", "\ndef _f():\n    import sglang\n")
    _write(tmp_path / "mooncake_connector" / "__init__.py", "\ndef _f():\n    import sglang\n")
    _write(tmp_path / "mooncake_kv" / "demo.py", "\ndef _f():\n    from mooncake_kv.devtools import llama\n")
    _write(tmp_path / "store_backend" / "plans.py", "\ndef _f():\n    from store_backend import slots\n")
    _write(tmp_path / "store_backend" / "types.py", "\ndef _f():\n    from store_backend.pool import tier\n")
    _write(tmp_path / "store_backend" / "pool" / "tier.py", "\ndef _f():\n    from store_backend.node import text\n")
    _write(tmp_path / "store_backend" / "node" / "client.py", "\ndef _f():\n    from store_backend.pool import tier\n")
    _write(tmp_path / "store_backend" / "core" / "stats.py", "\ndef _f():\n    from store_backend import store\n")
    _write(tmp_path / "store_backend" / "events" / "translate.py", "\ndef _f():\n    from store_backend.core import reads\n")
    proc = _run(tmp_path, tmp_path / "pyproject.toml")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"Contracts: 0 kept, {_contracts(tmp_path / 'pyproject.toml')} broken." in out, out
    for importer, imported in [("store_backend._upward", "mooncake_connector.keys"),
                               ("store_backend._upward", "torch"),
                               ("sglang_hicache", "vllm_plugin"),
                               ("sglang_hicache", "vllm"),
                               ("vllm_plugin", "sglang"),
                               ("mooncake_connector", "sglang"),
                               ("mooncake_kv.demo", "mooncake_kv.devtools.llama"),
                               ("store_backend.plans", "store_backend.slots"),
                               ("store_backend.types", "store_backend.pool.tier"),
                               ("store_backend.pool.tier", "store_backend.node.text"),
                               ("store_backend.node.client", "store_backend.pool.tier"),
                               ("store_backend.core.stats", "store_backend.store"),
                               ("store_backend.events.translate", "store_backend.core.reads")]:
        assert re.search(rf"{re.escape(importer)} -> {re.escape(imported)}\b", out), (importer, imported, out)
