"""The full suite's xdist scheduler: whole modules per worker (as ``--dist loadscope``), and at most
one worker in an engine module while modules of the other tiers are left.

An engine module (vLLM or SGLang engines: ``conftest._module_tier``) keeps a core busy for most of
its run; the other modules often wait (timeouts under test, Redis failovers, killed peers) and leave
theirs half idle. Handed out in xdist's order (the modules with most tests first), the light modules
ran side by side for the first five minutes at about 55 % of the two cores, and the engine modules
side by side after that, each slowed by the other. Here a worker that asks for work gets the next
engine module only if no other worker holds one, else the next light module; when one kind runs out,
both take the other. ``tests/conftest.py`` installs it (``pytest_xdist_make_scheduler``) when the
run is distributed by scope (``scripts/test.sh``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xdist.scheduler import LoadScopeScheduling


class EngineLaneScheduling(LoadScopeScheduling):
    """``LoadScopeScheduling`` whose next scope depends on what the other workers hold.

    ``is_heavy(scope)`` says whether a scope (a module's node id) starts engines. Pure choice over
    xdist's own bookkeeping (``workqueue``: scope -> {nodeid: done}, in xdist's order;
    ``assigned_work``: worker -> its scopes)."""

    def __init__(self, config: Any, log: Any = None, *, is_heavy: Callable[[str], bool]) -> None:
        super().__init__(config, log)
        self._is_heavy = is_heavy
        self._heavy: dict[str, bool] = {}

    def heavy(self, scope: str) -> bool:
        if scope not in self._heavy:
            self._heavy[scope] = self._is_heavy(scope)
        return self._heavy[scope]

    def next_scope(self, node: Any) -> str:
        """The scope ``node`` gets next: an engine module while no other worker has one pending,
        else a light one; the first of the other kind when its own kind has run out; a scope
        whose tests all ran (a crashed worker's, queued again whole) only when nothing else is left."""
        others_heavy = any(self.heavy(scope) and not all(unit.values())
                           for other, work in self.assigned_work.items() if other is not node
                           for scope, unit in work.items())
        want = not others_heavy
        # A crashed worker's modules come back whole, finished ones included: those go last.
        pending = [scope for scope, unit in self.workqueue.items() if not all(unit.values())]
        for scope in pending:
            if self.heavy(scope) == want:
                return scope
        return pending[0] if pending else next(iter(self.workqueue))

    def _assign_work_unit(self, node: Any) -> None:
        scope = self.next_scope(node)
        work_unit = self.workqueue.pop(scope)
        self.assigned_work.setdefault(node, {})[scope] = work_unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])
