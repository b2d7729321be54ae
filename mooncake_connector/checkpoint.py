"""The identity of a checkpoint's files, for the key fingerprint: new weights never share old keys.

Engine connectors call :func:`files_stamp` once at construction (any thread) and put the result
in :class:`mooncake_connector.keys.ModelFingerprint`'s ``weights`` field. Replacing the weights at
the same path (a new fine-tune copied over the old one, a re-download) changes a file's size,
mtime or, in a Hugging Face cache snapshot, the content-addressed blob a file links to, and with it
the stamp; KV saved under the old weights is then never found. Pipelines that keep size and mtime
(``cp -p``/``rsync -a`` from a source with normalized mtimes, reproducible image builds) are caught
by a sparse sample of each file's content: :data:`SAMPLE_COUNT` pieces of :data:`SAMPLE_BYTES`
(head, tail and evenly spaced between), 512 KiB per file at most, the whole file when smaller.
Weights that differ only outside the sampled pieces keep the stamp; a fine-tune or another
checkpoint changes nearly every byte.

:func:`hub_snapshot` finds the local snapshot of a Hugging Face hub id (offline, from the cache),
so a hub id is stamped by the commit it resolved to and the files it holds.
"""

from __future__ import annotations

import logging
import os

import xxhash

logger = logging.getLogger(__name__)

# Files whose change can change the KV of a token: weights (every format vLLM and SGLang load) and
# the JSON configs (model config, quantization config). Tokenizer files are covered too (a JSON),
# which costs a miss at worst.
# Python files: a ``trust_remote_code`` model's modelling code computes its KV.
STAMPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".npz", ".msgpack", ".py")

# Content sample per stamped file. Measured on a 1 GiB file on this project's test machine (five
# runs): 0.12-0.17 ms with the file in the page cache, 1-11 ms with its pages evicted first
# (posix_fadvise DONTNEED; eight 64 KiB reads from a virtual disk). A network file system adds a
# round trip per piece; a 30-file checkpoint reads 15 MiB in all.
SAMPLE_BYTES = 64 * 1024
SAMPLE_COUNT = 8


def content_sample(path: str, size: int) -> bytes:
    """xxh3_128 digest (16 bytes) of ``SAMPLE_COUNT`` pieces of ``SAMPLE_BYTES`` of the file at
    ``path`` (``size`` bytes, from its ``stat``): at offsets evenly spaced from the head to the
    tail, or the whole file when it is no larger than the pieces. Blocking (8 ``pread`` at most).
    Raises OSError when the file cannot be read."""
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if size <= SAMPLE_BYTES * SAMPLE_COUNT:
            offsets = range(0, size, SAMPLE_BYTES)
        else:
            last = size - SAMPLE_BYTES
            offsets = [last * i // (SAMPLE_COUNT - 1) for i in range(SAMPLE_COUNT)]
        for off in offsets:
            h.update(os.pread(fd, SAMPLE_BYTES, off))
    finally:
        os.close(fd)
    return h.digest()


def files_stamp(path: str) -> str | None:
    """A stamp of the checkpoint at ``path`` (a directory, or a single weights file), or None when
    ``path`` is neither (e.g. a hub id).

    Covers, for every stamped file at the top level of the directory (or the file itself): its
    name, size, mtime (ns), a sparse sample of its content (:func:`content_sample`) and, when it is
    a symbolic link, the name of its target (a Hugging Face snapshot links each file to a blob named
    by its content hash). Blocking (``stat`` and at most 512 KiB read per file). A file that cannot
    be read is stamped as unreadable (and a warning names it), so the stamp changes when it becomes
    readable again.
    """
    if os.path.isfile(path):
        entries = [path]
    elif os.path.isdir(path):
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            logger.warning("cannot list checkpoint directory %s (%s); weights identity unknown", path, e)
            return None
        entries = [os.path.join(path, n) for n in names if n.endswith(STAMPED_SUFFIXES)]
    else:
        return None
    h = xxhash.xxh3_128()
    for full in entries:
        try:
            st = os.stat(full)
        except OSError:
            continue  # a dangling link or a file removed meanwhile: not part of what loads
        if not os.path.isfile(full):
            continue
        target = os.path.basename(os.readlink(full)) if os.path.islink(full) else ""
        try:
            sample = content_sample(full, st.st_size).hex()
        except OSError as e:
            logger.warning("cannot read %s for the weights stamp (%s)", full, e)
            sample = "unreadable"
        h.update(f"{os.path.basename(full)}\0{st.st_size}\0{st.st_mtime_ns}\0{target}\0{sample}\n".encode())
    return h.hexdigest()


def hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None = None) -> tuple[str, str] | None:
    """(commit hash, snapshot directory) of ``repo_id`` at ``revision`` in the local Hugging Face
    cache (``cache_dir``, default the hub's), or None when it is not cached there (or
    huggingface_hub is missing). Offline, blocking."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    except Exception:  # a malformed repo id and friends: not a hub id we can resolve
        return None
    if not isinstance(found, str):
        return None
    snapshot = os.path.dirname(found)
    return os.path.basename(snapshot), snapshot
