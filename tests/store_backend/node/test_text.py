"""The sizes the status commands print."""

from __future__ import annotations

import pytest

from store_backend.node.text import human_bytes


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                         (16 << 20, "16.0 MiB"), (3 << 30, "3.0 GiB"), (2048 << 40, "2048.0 TiB")])
def test_sizes_are_in_binary_units_with_one_decimal_past_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text
