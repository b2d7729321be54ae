"""docs/CONFIG.md is generated from the config Structs and must match them; every key is explained."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_current() -> None:
    text = _generator().render()
    assert (ROOT / "docs" / "CONFIG.md").read_text() == text, (
        "docs/CONFIG.md is out of date: run python scripts/config_reference.py > docs/CONFIG.md")


def test_every_key_has_a_meaning() -> None:
    gen = _generator()
    undocumented = [f"{cls.__name__}.{name}" for _h, _w, cls in gen.SECTIONS
                    for name, text in ((f, gen.field_comments(cls).get(f, "")) for f in cls.__struct_fields__)
                    if not text]
    assert undocumented == [], f"config fields without a comment above them: {undocumented}"
