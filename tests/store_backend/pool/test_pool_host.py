"""The pool's seams to the store (store_backend/pool/host.py): the store implements ``PoolHost``
with the same signatures, the local view the transport server serves implements ``PeerView``, and
the pool's modules call nothing else on the store they are given."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from store_backend.pool.host import PeerView, PoolHost
from store_backend.pool.service import local_view
from store_backend.store import TieredStore

POOL = Path(__file__).resolve().parents[3] / "store_backend" / "pool"


def _members(proto: type = PoolHost) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(proto).items()
            if callable(fn) and not name.startswith("_")}


def test_the_store_implements_every_method_of_the_seam_with_its_signature() -> None:
    members = _members()
    assert len(members) >= 15, members
    assert set(PoolHost.__annotations__) == {"config"}
    assert "config" in inspect.signature(TieredStore.__init__).parameters  # the store keeps its config
    for name, want in members.items():
        got = inspect.signature(getattr(TieredStore, name))
        shape = [(p.name, p.kind, p.default) for p in got.parameters.values()]
        assert shape == [(p.name, p.kind, p.default) for p in want.parameters.values()], (name, got, want)


def _store_calls(path: Path) -> set[str]:
    """Every attribute taken of a store in ``path``: ``store.X``, ``self._store.X``,
    ``self.store.X`` and ``getattr(<one of those>, "X"...)``."""
    def is_store(node: ast.AST) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "store")
                or (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and node.attr in ("_store", "store")))

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and is_store(node.value):
            found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and is_store(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            found.add(node.args[1].value)
    return found


def test_the_pool_calls_only_the_seams_methods_on_its_store() -> None:
    used: dict[str, set[str]] = {}
    for path in sorted(POOL.glob("*.py")):
        calls = _store_calls(path)
        if calls:
            used[path.name] = calls
    assert {"tcp_server.py", "registrar.py", "replicator.py", "service.py"} <= set(used), used
    outside = {}
    for name, calls in used.items():
        proto = PeerView if name == "tcp_server.py" else PoolHost  # the server is given a local view
        allowed = set(_members(proto)) | set(proto.__annotations__)
        if calls - allowed:
            outside[name] = sorted(calls - allowed)
    assert outside == {}, f"store methods the pool calls that its seam does not name: {outside}"


def test_the_local_view_serves_peers_what_peer_view_names() -> None:
    view = type(local_view(object()))
    host = _members(PoolHost)
    for name, want in _members(PeerView).items():
        own = vars(view).get(name)
        if own is None:
            # Passed through to the store: the store's method takes every argument the view's does.
            assert name in host, name
            got = host[name]
        else:
            got = inspect.signature(own)
        params = got.parameters
        takes_more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for p in want.parameters.values():
            assert p.name in params or takes_more, (name, p.name, got)
    # A pool-wide remove's time reaches the view's own remove; its reads and removes stay local.
    assert "before_s" in inspect.signature(view.remove).parameters
    assert {"lease", "remove"} <= set(vars(view))


def test_the_scan_sees_a_call_outside_the_seam(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("def f(store, self):\n    store.get_into([], [])\n    getattr(self._store, 'flush')()\n")
    assert _store_calls(src) == {"get_into", "flush"}
