"""The secret file and the Redis password file pass the same private-file check, each error naming
its field and the path."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from store_backend.pool.config import PoolConfig
from store_backend.pool.directory_redis import read_password_file
from store_backend.pool.private_file import private_file_problem


def test_a_regular_file_without_group_or_other_bits_is_private(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    for mode, problem in [(0o600, None), (0o400, None), (0o640, "mode 0640"), (0o602, "mode 0602")]:
        os.chmod(path, mode)
        got = private_file_problem(str(path))
        assert got is None if problem is None else problem in got, (oct(mode), got)
    assert private_file_problem(str(tmp_path)) == "is not a regular file"
    with pytest.raises(FileNotFoundError):
        private_file_problem(str(tmp_path / "missing"))


def test_both_callers_name_their_field_and_the_path(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("pw\n")
    os.chmod(path, 0o644)
    p = re.escape(str(path))
    with pytest.raises(ValueError, match=rf"^password_file {p} is readable by group or other \(mode 0644\): chmod 600 it$"):
        read_password_file(str(path))
    with pytest.raises(ValueError, match=rf"^secret_file: {p} is readable by group or other \(mode 0644\): chmod 600 it$"):
        PoolConfig(secret_file=str(path)).read_secret()
    d = re.escape(str(tmp_path))
    with pytest.raises(ValueError, match=rf"^password_file {d} is not a regular file$"):
        read_password_file(str(tmp_path))
    with pytest.raises(ValueError, match=rf"^secret_file: {d} is not a regular file$"):
        PoolConfig(secret_file=str(tmp_path)).read_secret()
    os.chmod(path, 0o600)
    assert read_password_file(str(path)) == "pw"
