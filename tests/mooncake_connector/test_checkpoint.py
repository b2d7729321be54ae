"""Checkpoint identity for the fingerprint: a stamp of the weight files, and hub snapshots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncake_connector.checkpoint import files_stamp, hub_snapshot


def test_stamp_changes_when_a_weight_file_is_replaced_with_one_of_the_same_size(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    w = tmp_path / "model-00001-of-00002.safetensors"
    w.write_bytes(b"a" * 1000)
    (tmp_path / "README.md").write_text("not a weight")
    s1 = files_stamp(str(tmp_path))
    assert s1 is not None and s1 == files_stamp(str(tmp_path))
    (tmp_path / "README.md").write_text("edited: not part of the stamp")
    assert files_stamp(str(tmp_path)) == s1
    st = w.stat()
    w.write_bytes(b"b" * 1000)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert files_stamp(str(tmp_path)) != s1
    # A single weights file (e.g. GGUF) is stamped by itself; a hub id is not a path.
    assert files_stamp(str(w)) is not None
    assert files_stamp("org/model-that-is-not-a-path") is None


def test_hub_snapshot_resolves_the_cached_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "sha-config").write_text("{}")
    (repo / "blobs" / "sha-weights-1").write_bytes(b"w" * 64)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/sha-config")
    (snap / "model.safetensors").symlink_to("../../blobs/sha-weights-1")
    assert hub_snapshot("org/tiny", None) == (commit, str(snap))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_snapshot("org/tiny", None) is None
    assert hub_snapshot("org/tiny", None, cache_dir=str(tmp_path)) == (commit, str(snap))  # vLLM's download_dir
    assert hub_snapshot("org/other", None) is None
    s1 = files_stamp(str(snap))
    # A new download of the same revision links to another content-addressed blob.
    (repo / "blobs" / "sha-weights-2").write_bytes(b"w" * 64)
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to("../../blobs/sha-weights-2")
    os.utime(repo / "blobs" / "sha-weights-2", ns=(0, (repo / "blobs" / "sha-weights-1").stat().st_mtime_ns))
    assert files_stamp(str(snap)) != s1
