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


def test_stamp_changes_when_content_changes_under_the_same_size_and_mtime(tmp_path: Path) -> None:
    # cp -p / rsync -a from a source with normalized mtimes, reproducible builds: only the bytes differ.
    big = tmp_path / "model-00001-of-00001.safetensors"
    small = tmp_path / "config.json"
    big.write_bytes(bytes(3 * 1024 * 1024))  # larger than the sampled pieces together
    small.write_text('{"rope_theta": 10000.0}')
    fixed_ns = 1_600_000_000 * 10**9
    for f in (big, small):
        os.utime(f, ns=(fixed_ns, fixed_ns))
    s1 = files_stamp(str(tmp_path))
    # Another small config of the same length.
    small.write_text('{"rope_theta": 50000.0}')
    os.utime(small, ns=(fixed_ns, fixed_ns))
    s2 = files_stamp(str(tmp_path))
    assert s2 != s1
    # Other weights of the same size (a fine-tune changes nearly every byte): a byte in the head,
    # in one of the evenly spaced middle pieces, in the tail.
    size = 3 * 1024 * 1024
    for offset in (0, 3 * (size - 64 * 1024) // 7 + 100, size - 1):
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\x01")
        os.utime(big, ns=(fixed_ns, fixed_ns))
        s3 = files_stamp(str(tmp_path))
        assert s3 != s2
        s2 = s3
    assert big.stat().st_size == 3 * 1024 * 1024 and big.stat().st_mtime_ns == fixed_ns


def test_trust_remote_code_modelling_files_are_stamped(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    code = tmp_path / "modeling_custom.py"
    code.write_text("ROPE_THETA = 10000.0\n")
    s1 = files_stamp(str(tmp_path))
    st = code.stat()
    code.write_text("ROPE_THETA = 500000.\n")  # same size
    os.utime(code, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files_stamp(str(tmp_path)) != s1


def test_content_sample_reads_at_most_the_sampled_pieces(tmp_path: Path) -> None:
    from mooncake_connector.checkpoint import SAMPLE_BYTES, SAMPLE_COUNT, content_sample

    f = tmp_path / "w.bin"
    f.write_bytes(bytes(SAMPLE_BYTES * SAMPLE_COUNT * 4))
    size = f.stat().st_size
    reads: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, off: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, off)

    os.pread = counting_pread  # type: ignore[assignment]
    try:
        content_sample(str(f), size)
    finally:
        os.pread = real_pread  # type: ignore[assignment]
    assert len(reads) == SAMPLE_COUNT and sum(reads) <= 512 * 1024
