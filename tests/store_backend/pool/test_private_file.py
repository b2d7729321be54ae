"""The secret file and the Redis password file pass the same private-file check, each error naming
its field and the path; a node config file that holds a secret inline must be private too."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from store_backend.config import ConfigError
from store_backend.node.config import load_node_config
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


# -- a config file holding a secret inline --------------------------------------------------------

def _node_config(tmp_path: Path, pool: dict, mode: int, name: str = "node.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"socket": str(tmp_path / "s" / "node.sock"), "pool": pool}))
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("pool, field, file_field", [
    ({"secret": "pool-s3cret"}, "pool.secret", "pool.secret_file"),
    ({"secret_file": "/nonexistent/secret",
      "directory": {"kind": "redis", "url": "redis://:redis-s3cret@127.0.0.1:1/0"}},
     "pool.directory.url", "pool.directory.password_file"),
    ({"secret_file": "/nonexistent/secret",
      "directory": {"kind": "redis", "url": "redis://127.0.0.1:1/0?password=redis-s3cret"}},
     "pool.directory.url", "pool.directory.password_file"),
])
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=oct)
def test_a_config_file_holding_a_secret_that_others_may_read_is_refused(tmp_path: Path, pool: dict, field: str,
                                                                         file_field: str, mode: int) -> None:
    path = _node_config(tmp_path, pool, mode)
    with pytest.raises(ConfigError) as e:
        load_node_config(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{field}: the config file {path} holds this secret inline and is readable by group or other")
    assert f"mode {mode:04o}" in msg and f"chmod 600 {path}" in msg and file_field in msg
    assert "s3cret" not in msg
    os.chmod(path, 0o600)
    assert load_node_config(str(path)).pool is not None


def test_a_config_file_without_an_inline_secret_may_be_readable(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    path = _node_config(tmp_path, {"secret_file": str(secret),
                                   "directory": {"kind": "redis", "url": "redis://pool@127.0.0.1:1/0"}}, 0o644)
    assert load_node_config(str(path)).pool is not None
    # A dict is no file: nothing to check.
    assert load_node_config({"pool": {"secret": "s3cret"}}).pool is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_config_file_holding_a_secret_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = _node_config(tmp_path, {"secret": "s3cret"}, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match=rf"^pool\.secret: the config file {re.escape(str(path))} holds this secret "
                                          r"inline and is owned by uid 65534, not by this user \(uid 0\) or root "
                                          r"\(owner uid 65534, mode 0600\)"):
        load_node_config(str(path))
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    os.chown(secret, 65534, 65534)  # the same rule for a secret file
    with pytest.raises(ValueError, match=r"^secret_file: .* is owned by uid 65534, not by this user"):
        PoolConfig(secret_file=str(secret)).read_secret()
