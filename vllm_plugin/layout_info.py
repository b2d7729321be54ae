"""The engine's KV layout in vLLM's ``/metrics``: the info gauge
:data:`~mooncake_connector.kv_layout.LAYOUT_INFO`, for routers pairing prefill with decode.

The scheduler knows the layout from its start (its fingerprints), but vLLM hands connector stats
to the frontend only after an engine step, and a router asks before any request. So:

- the scheduler (engine-core process) writes its layout to a small file beside the lookup sockets
  when it starts (:func:`publish_layout`), before vLLM reports the engine ready, and removes it
  when it closes (:func:`withdraw_layout`); files of engines killed before they could close are
  removed by the next one that starts there;
- the frontend's Prometheus metrics, which vLLM builds once the engine core is ready, read it
  (:func:`read_layout`) and set the gauge before the first request;
- every scheduler stats payload carries it as well (:func:`layout_payload`), so the gauge is set
  from the first step where the frontend cannot read the file (an engine core on another host).

Called once per process at start and close; a file that cannot be written or read is logged and
the gauge then comes with the first step.
"""

from __future__ import annotations

import glob
import logging
import os
import tempfile

import msgspec
import xxhash

from mooncake_connector.kv_layout import LAYOUT_INFO, KVLayout
from store_backend.prometheus import payload_key

logger = logging.getLogger(__name__)


class _LayoutFile(msgspec.Struct, frozen=True):
    pid: int  # the scheduler's process, so a file it left behind when killed can be told apart
    layout: KVLayout


def layout_path(engine_name: str, directory: str | None = None) -> str:
    """Where the scheduler of engine ``engine_name`` (:func:`vllm_plugin.parallel.engine_name`)
    leaves its layout: ``directory`` (the connector's ``lookup_socket_dir``; None: TMPDIR)."""
    return os.path.join(directory or tempfile.gettempdir(),
                        f"mooncake-kv-{xxhash.xxh64_hexdigest(engine_name.encode())}.layout.json")


def publish_layout(path: str, layout: KVLayout) -> bool:
    """Write ``layout`` to ``path`` (whole or not at all: a temporary file renamed over it), after
    removing the files of dead processes beside it. Returns False, with a warning, when it cannot
    be written."""
    _remove_stale(os.path.dirname(path))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(_LayoutFile(os.getpid(), layout)))
        os.replace(tmp, path)
        return True
    except OSError as e:
        logger.warning("the KV layout could not be written to %s (%s): the engine's /metrics shows it "
                       "(%s) only from its first step", path, e, LAYOUT_INFO)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def read_layout(path: str) -> KVLayout | None:
    """The layout at ``path``; None when there is none (logged at DEBUG) or it cannot be read
    (a warning naming the file)."""
    got = _read(path, logging.WARNING)
    return got.layout if got is not None else None


def _read(path: str, level: int) -> _LayoutFile | None:
    """The file at ``path``; None (logged at ``level``) when it cannot be read or is not one."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        logger.debug("no KV layout at %s yet", path)
        return None
    except OSError as e:
        logger.log(level, "the KV layout at %s could not be read: %s", path, e)
        return None
    try:
        return msgspec.json.decode(data, type=_LayoutFile)
    except msgspec.DecodeError as e:
        logger.log(level, "the KV layout at %s is not one: %s", path, e)
        return None


def _remove_stale(directory: str) -> None:
    """Unlink layout files whose scheduler process is gone (killed before it could close)."""
    for path in glob.glob(os.path.join(directory, "mooncake-kv-*.layout.json")):
        got = _read(path, logging.DEBUG)
        if got is None or _alive(got.pid):
            continue
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def withdraw_layout(path: str, layout: KVLayout) -> None:
    """Remove ``path`` if it still holds ``layout`` (a later engine of the same name may have
    replaced it)."""
    if read_layout(path) == layout:
        try:
            os.unlink(path)
        except OSError:
            pass


def layout_payload(layout: KVLayout) -> dict[str, dict[str, int]]:
    """The gauge as a stats payload (one sample, value 1)."""
    return {LAYOUT_INFO: {payload_key(layout.label_values()): 1}}
