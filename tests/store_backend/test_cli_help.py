"""``mooncake-kv SUBCOMMAND --help`` shows that subcommand's own options."""

from __future__ import annotations

import pytest

from mooncake_kv.cli import main


@pytest.mark.parametrize(("argv", "expected"), [
    (["inspect", "--help"], "--verify"),
    (["demo", "--help"], "--trace"),
    (["replay", "--help"], "traces"),
    (["bench", "store", "--help"], "--batch-bytes"),
    (["bench", "--help"], "store"),
    (["--help"], "inspect"),
])
def test_help_lists_the_subcommands_options(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert expected in capsys.readouterr().out
