"""docs/CONFIG.md is generated from the config Structs and must match them; every key is explained."""

from __future__ import annotations

from tests.generated_docs import assert_current, generator


def _generator():
    return generator("config_reference")


def test_reference_is_current() -> None:
    assert_current("config_reference", "CONFIG.md")


def test_every_key_has_a_meaning() -> None:
    gen = _generator()
    undocumented = [f"{cls.__name__}.{name}" for _h, _w, cls in gen.SECTIONS
                    for name, text in ((f, gen.field_comments(cls).get(f, "")) for f in cls.__struct_fields__)
                    if not text]
    assert undocumented == [], f"config fields without a comment above them: {undocumented}"
