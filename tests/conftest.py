"""Suite-wide rules.

**Tiers.** Every test is sorted here, by its module and its fixtures, so that a new test cannot
forget: ``engine`` (its module starts vLLM or SGLang engines: it names one of the engine runners),
``procs`` (its module starts other processes: node services, Redis, clients, CLIs; or it uses a
fixture that does), ``slow`` (listed in :data:`_SLOW`, from measured durations). Plain ``pytest``
runs the fast tier (``-m "not engine and not procs and not slow"`` in pyproject's addopts, with a
lighter hypothesis profile); ``scripts/test.sh`` (the README's command, what CI runs) passes
``-m ""``: everything. A test outside ``engine`` and ``procs`` that starts a process anyway fails,
naming the rule to fix (:func:`_no_process_outside_its_tier`). docs/TESTING.md has the budget.

Under CI (the ``CI`` environment variable set, as ``.ci/run`` runs), a test or test module that
skips — a missing vLLM, SGLang or Redis, an io_uring or tmpfs probe that failed — is reported as a
failure instead, so a missing install step can never pass as green. Tests that need hardware CI
does not have (a GPU) carry the ``gpu`` marker and are deselected there rather than skipped.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import proclogs

_UNDER_CI = bool(os.environ.get("CI"))
_TESTS = Path(__file__).resolve().parent

# A test module that names one of these starts engines (each runner starts vLLM or SGLang).
_ENGINE_NAMES = re.compile(r"\b(run_engine|engine_runner|vllm_kv_runner|node_fault_runner|disagg_cluster|"
                           r"vllm_prefix_reuse|bench_serve|LLM\()|\"bench\",\s*\"serve\"")
# ... one of these starts other processes (directly, or through a harness that does).
_PROCS_NAMES = re.compile(r"\b(subprocess|Popen|multiprocessing|get_context|os\.fork|ServiceProcess|OtherProcess|"
                          r"ClientProcess|RedisProcess|redis_server|pool_nodes|PoolNodes|netns|SentinelCluster|"
                          r"sentinel|rank_writer|node_rank|fork|BenchNodeService|spawn_service)\b")
# Short tool runs a test (or a library under it) may make in any tier: probes and mounts, no servers.
_TOOLS = frozenset({"ninja", "c++", "g++", "gcc", "cc", "mount", "umount", "ldconfig", "nvidia-smi", "uname"})
# Python modules a library runs once as a probe: vLLM inspects a model architecture in a child process
# the first time a machine sees it (cached under ~/.cache/vllm after).
_TOOL_MODULES = frozenset({"vllm.model_executor.models.registry"})
# Fixtures that start processes, wherever they are used.
_PROCS_FIXTURES = frozenset({"redis_server", "pool", "service", "redis_pool", "sentinels"})
# Parameters that make a parametrised fixture start one (a directory contract case against Redis).
_PROCS_PARAMS = frozenset({("directory_kind", "redis")})
# Tests of the fast tier's modules that take more than a few seconds (docs/TESTING.md has the
# measured table): module path relative to tests/, or "path::test name prefix".
_SLOW: tuple[str, ...] = (
    "mooncake_kv/test_replay.py::test_replay_with_an_ssd_tier_is_deterministic",  # 8 s
    "mooncake_kv/test_replay.py::test_cli_prints_the_summary_last",  # 7 s
)

_TIER_MARKERS = ("engine", "procs", "slow")


_BASETEMP_KEEP = 3


def _short_basetemp(config: pytest.Config) -> None:
    """Under pytest-xdist each worker's temporary directories sit one level deeper (``popen-gwN``),
    and the sockets tests make in them must stay within AF_UNIX's 107 bytes: the run's base is a
    short ``/tmp/mkt-*`` instead (the newest few are kept for reading, as pytest keeps its own)."""
    if config.option.basetemp or hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    root = Path(tempfile.gettempdir())
    config.option.basetemp = tempfile.mkdtemp(prefix="mkt-", dir=root)
    mine = [p for p in root.glob("mkt-*") if p.is_dir() and p.stat().st_uid == os.getuid()]
    for old in sorted(mine, key=lambda p: p.stat().st_mtime)[:-_BASETEMP_KEEP - 1]:
        shutil.rmtree(old, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _short_basetemp(config)
    config.addinivalue_line("markers", "gpu: needs a CUDA device (deselected when there is none)")
    config.addinivalue_line("markers", "engine: starts vLLM or SGLang engines (set by tests/conftest.py)")
    config.addinivalue_line("markers", "procs: starts node services, Redis or other processes (set by tests/conftest.py)")
    if _fast_tier(config) and _names_test_files(config):
        # `pytest tests/x/test_y.py` (or a node id) runs what it names, whatever its tier.
        config.option.markexpr = ""
    if _fast_tier(config):
        try:
            from hypothesis import settings
        except ImportError:
            return
        settings.register_profile("fast", max_examples=25, deadline=None)
        settings.load_profile("fast")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``--dist loadscope`` (scripts/test.sh): whole modules per worker, at most one worker in
    an engine module while other modules are left (tests/xdist_lanes.py)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from tests.xdist_lanes import EngineLaneScheduling

    root = config.rootpath
    return EngineLaneScheduling(config, log, is_heavy=lambda scope: _module_tier(
        str(root / scope.split("::", 1)[0])) == "engine")


def _names_test_files(config: pytest.Config) -> bool:
    return any("::" in a or a.endswith(".py") for a in config.args)


def _fast_tier(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    return all(f"not {m}" in expr for m in _TIER_MARKERS)


@functools.lru_cache(maxsize=None)
def _module_tier(path: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if _ENGINE_NAMES.search(text):
        return "engine"
    if _PROCS_NAMES.search(text):
        return "procs"
    return None


def _is_slow(item: pytest.Item) -> bool:
    rel = Path(str(item.fspath)).resolve().relative_to(_TESTS).as_posix()
    return any(rel == s or (s.startswith(rel + "::") and item.name.startswith(s.split("::", 1)[1])) for s in _SLOW)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _module_tier(str(item.fspath))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if tier is None and (_PROCS_FIXTURES.intersection(getattr(item, "fixturenames", ()))
                             or any((k, v) in _PROCS_PARAMS for k, v in params.items() if isinstance(v, str))):
            tier = "procs"
        if tier is not None and item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        if _is_slow(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    dropped = [it for it in items if it.get_closest_marker("gpu") is not None]
    if dropped and not _has_cuda():
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it.get_closest_marker("gpu") is None]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _fail_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (_UNDER_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI, where every dependency must be installed: {reason}"


_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *a, **kw):  # type: ignore[no-untyped-def]
    """Every process of the session is recorded, so that a failed test prints what its own wrote."""
    _popen_init(self, args, *a, **kw)
    pos = dict(zip(("bufsize", "executable", "stdin", "stdout", "stderr"), a))
    proclogs.record(self, args, kw.get("stdout", pos.get("stdout")), kw.get("stderr", pos.get("stderr")))


subprocess.Popen.__init__ = _recording_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    proclogs.set_current(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    _fail_skip(report)
    if report.failed and call.when in ("setup", "call"):
        section = proclogs.report(item.nodeid)
        if section:
            report.sections.append(("processes this test started, and their logs", section))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.fixture(autouse=True)
def _no_process_outside_its_tier(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked neither ``engine`` nor ``procs`` may not start a process: the tier rules above
    did not see it coming, so it would slow the fast tier down. It fails naming what to change."""
    item = request.node
    if item.get_closest_marker("procs") is not None or item.get_closest_marker("engine") is not None:
        yield
        return
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def refuse(what: str) -> None:
        pytest.fail(f"{item.nodeid} starts a process ({what}) but is in the fast tier: name the harness that "
                    f"starts it in tests/conftest.py (_PROCS_NAMES or _PROCS_FIXTURES), or mark the test "
                    f"@pytest.mark.procs", pytrace=False)

    def guarded_popen(self, args, *a, **kw):  # type: ignore[no-untyped-def]
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if argv and os.path.basename(os.fsdecode(argv[0]).split()[0]) in _TOOLS:
            return popen_init(self, args, *a, **kw)
        if len(argv) > 2 and os.fsdecode(argv[1]) == "-m" and os.fsdecode(argv[2]) in _TOOL_MODULES:
            return popen_init(self, args, *a, **kw)
        refuse(f"subprocess {args!r:.80}")

    def guarded_start(self):  # type: ignore[no-untyped-def]
        refuse(f"multiprocessing {type(self).__name__}")

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
        multiprocessing.process.BaseProcess.start = process_start  # type: ignore[method-assign]
