"""The full suite's scheduler (tests/xdist_lanes.py), driven through xdist's scheduler interface as
xdist's controller drives it: at most one worker in an engine module while light modules are left."""

from __future__ import annotations

from types import SimpleNamespace

from tests.xdist_lanes import EngineLaneScheduling


class _Config:
    """What xdist's scope scheduler reads of the run's config: two workers, xdist's own order."""

    option = SimpleNamespace(loadscopereorder=True)

    def getvalue(self, name: str) -> object:
        return {"tx": ["2*popen"]}.get(name)


class _Worker:
    """A worker as the scheduler sees it: it records what it was sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _collection(modules: list[str], tests: int = 3) -> list[str]:
    return [f"tests/{m}.py::t{i}" for m in modules for i in range(tests)]


def _scopes(worker: _Worker, collection: list[str]) -> list[str]:
    return [collection[batch[0]].split("::")[0].removeprefix("tests/").removesuffix(".py") if batch else "(nothing)"
            for batch in worker.sent]


def _scheduled(collection: list[str]) -> tuple[EngineLaneScheduling, _Worker, _Worker]:
    """A scheduler with two workers that collected ``collection``, after xdist's first round."""
    sched = EngineLaneScheduling(_Config(), is_heavy=lambda scope: "engine" in scope)
    a, b = _Worker("a"), _Worker("b")
    for w in (a, b):
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    return sched, a, b


def _finish(sched: EngineLaneScheduling, worker: _Worker, collection: list[str], batch: int) -> None:
    for i in worker.sent[batch]:
        sched.mark_test_complete(worker, i)


def test_one_worker_runs_engine_modules_while_the_other_runs_light_ones() -> None:
    collection = _collection(["light1", "engine1", "light2", "engine2", "light3"])
    sched, a, b = _scheduled(collection)
    # The first asker takes the first engine module; the second, with an engine module held, a light one.
    assert (_scopes(a, collection), _scopes(b, collection)) == (["engine1"], ["light1"])
    _finish(sched, b, collection, 0)  # b done first: a still holds engine1, so b stays light
    assert _scopes(b, collection) == ["light1", "light2"]
    _finish(sched, a, collection, 0)  # a done: b holds a light module, so a takes the next engine one
    assert _scopes(a, collection) == ["engine1", "engine2"]
    _finish(sched, b, collection, 1)
    assert _scopes(b, collection) == ["light1", "light2", "light3"]


def test_when_one_kind_runs_out_both_workers_take_the_other() -> None:
    collection = _collection(["engine1", "engine2", "light1"])
    sched, a, b = _scheduled(collection)
    assert (_scopes(a, collection), _scopes(b, collection)) == (["engine1"], ["light1"])
    _finish(sched, b, collection, 0)  # no light module left: b takes an engine module beside a's
    assert _scopes(b, collection) == ["light1", "engine2"]
    _finish(sched, a, collection, 0)
    _finish(sched, b, collection, 1)
    assert a.shutting_down and b.shutting_down  # nothing left for either


def test_a_crashed_workers_finished_modules_are_not_handed_out_before_pending_ones() -> None:
    collection = _collection(["engine1", "light1", "engine2", "light2"])
    sched, a, b = _scheduled(collection)
    assert (_scopes(a, collection), _scopes(b, collection)) == (["engine1"], ["light1"])
    _finish(sched, a, collection, 0)  # a finished engine1 and took engine2 ...
    assert _scopes(a, collection) == ["engine1", "engine2"]
    sched.mark_test_complete(a, a.sent[1][0])  # ... ran one of its tests, then crashed
    sched.remove_node(a)  # xdist queues a's modules again, engine1 (all done) included
    _finish(sched, b, collection, 0)  # b holds no engine module: it wants one, and gets the pending one
    assert _scopes(b, collection) == ["light1", "engine2", "light2"]  # never engine1 again (nothing to run)
    assert b.sent[1] == [collection.index("tests/engine2.py::t1"), collection.index("tests/engine2.py::t2")]
