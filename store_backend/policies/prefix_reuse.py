"""Prefix-aware eviction: leaves of the prefix tree first, objects that were reused protected.

Two observations about KV-cache chunks drive this policy:

* A chunk is only useful with its whole prefix: a lookup counts leading hits, so a chunk whose
  parent is gone can never be hit again. The policy therefore tracks the prefix tree of resident
  objects (``parent`` of ``on_insert``) and only ever names *leaves* (objects without resident
  children) as victims; a parent becomes a candidate once its children are gone.
* On LLM traces the best online predictor of a future hit is a past one: a chunk requested a second
  time is reused again far more often than a fresh one (Mooncake's conversation trace: 24% of fresh
  chunks are ever reused, about half of the reused ones are reused again). Fresh chunks compete by
  plain recency; a chunk that has been requested twice or more (a hit, or a put of a key recently
  evicted, remembered in a bounded ghost list) stays ahead of fresh chunks for a *protection
  horizon* after its last use.

Time is counted in ticks (one per insert or hit). The horizon is learned: it is ``horizon_scale``
times the ``horizon_quantile`` quantile of the distances (in ticks) between successive uses of
reused objects, observed on hits and on re-puts of ghost keys, kept in a log-binned histogram that
halves now and then so it follows the workload. A fixed horizon is either too short for small
caches or, for large ones, keeps dead chunks for so long that it loses to LRU; the learned one tracks
how long reuse actually takes. Until enough distances are seen, ``initial_turnovers`` times the
resident object count is used.

Each object has one static priority, refreshed on every insert or hit: ``tick + horizon`` for
reused objects and ``tick`` for fresh ones. The leaf with the smallest priority is evicted first.
Leaves sit in a binary heap with lazy invalidation, so every operation costs O(log n) (plus O(1)
histogram upkeep); ``victims`` walks the heap without changing it.

Pure decision code (see ``base.py``): the owning tier calls it under its lock; not thread-safe.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_HORIZON_QUANTILE = 0.8
DEFAULT_HORIZON_SCALE = 2.0
# Horizon before enough reuse distances are known, in cache turnovers (resident objects).
DEFAULT_INITIAL_TURNOVERS = 8.0
# Evicted keys remembered (use count, parent, last use), as a multiple of the resident objects.
DEFAULT_GHOST_FACTOR = 4.0
MIN_GHOST_ENTRIES = 1024

_BINS_PER_OCTAVE = 4
_HIST_BINS = 64 * _BINS_PER_OCTAVE  # distances up to 2**64 ticks
_MIN_SAMPLES = 256  # distances needed before the learned horizon replaces the initial one
_RECOMPUTE_EVERY = 512  # samples between quantile updates
_HALVE_EVERY = 1 << 16  # samples between halvings of the histogram


class _Node:
    __slots__ = ("size", "parent", "children", "uses", "prio", "last")

    def __init__(self, size: int, parent: str | None, children: int, uses: int) -> None:
        self.size = size
        self.parent = parent
        self.children = children  # resident children
        self.uses = uses  # requests seen: the insert, every hit, and uses remembered from the ghost
        self.prio = 0.0
        self.last = 0  # tick of the last insert or hit


class ReuseDistanceHistogram:
    """Log-binned histogram of reuse distances (ticks) with periodic halving; O(1) per sample."""

    def __init__(self, quantile: float) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        self.quantile = quantile
        self._counts = [0.0] * _HIST_BINS
        self._samples = 0
        self.value: float | None = None  # the quantile, once enough samples are in

    def add(self, distance: int) -> None:
        b = int(_BINS_PER_OCTAVE * math.log2(distance)) if distance > 1 else 0
        self._counts[min(b, _HIST_BINS - 1)] += 1.0
        self._samples += 1
        if self._samples % _RECOMPUTE_EVERY == 0 and self._samples >= _MIN_SAMPLES:
            self._recompute()
        if self._samples % _HALVE_EVERY == 0:
            self._counts = [c * 0.5 for c in self._counts]

    def _recompute(self) -> None:
        target = self.quantile * sum(self._counts)
        acc = 0.0
        for b, c in enumerate(self._counts):
            acc += c
            if acc >= target:
                self.value = 2.0 ** ((b + 1) / _BINS_PER_OCTAVE)  # upper edge of the bin
                return


class PrefixReusePolicy:
    """Leaf-first eviction of the prefix tree; reused objects outrank fresh ones (see module doc).

    ``horizon_scale=0`` gives plain leaf-first LRU. ``ghost_factor`` bounds the ghost list of
    evicted keys at that many times the resident objects (at least ``MIN_GHOST_ENTRIES``).
    """

    name = "prefix_reuse"

    def __init__(
        self,
        horizon_quantile: float = DEFAULT_HORIZON_QUANTILE,
        horizon_scale: float = DEFAULT_HORIZON_SCALE,
        initial_turnovers: float = DEFAULT_INITIAL_TURNOVERS,
        ghost_factor: float = DEFAULT_GHOST_FACTOR,
    ) -> None:
        for label, value in (("horizon_scale", horizon_scale), ("initial_turnovers", initial_turnovers),
                             ("ghost_factor", ghost_factor)):
            if value < 0:
                raise ValueError(f"{label} must be >= 0, got {value}")
        self.horizon_scale = horizon_scale
        self.initial_turnovers = initial_turnovers
        self.ghost_factor = ghost_factor
        self.reuse_distances = ReuseDistanceHistogram(horizon_quantile)
        self._nodes: dict[str, _Node] = {}
        # Resident children of keys that are not resident themselves (inserted before their parent,
        # or left behind by an explicit remove of the parent).
        self._orphans: dict[str, int] = {}
        self._heap: list[tuple[float, str]] = []  # (prio, key) of leaves; stale entries skipped
        # evicted key -> (uses, parent, tick of its last use)
        self._ghost: OrderedDict[str, tuple[int, str | None, int]] = OrderedDict()
        self._tick = 0

    # -- events from the tier --------------------------------------------------------------------
    def on_insert(self, key: str, size: int, parent: str | None = None) -> None:
        if key in self._nodes:  # re-insert of a resident key: treat as a use
            self.on_access(key)
            return
        remembered = self._ghost.pop(key, None)
        uses = 1
        if remembered is not None:
            uses += remembered[0]
            if remembered[0] > 1:
                self.reuse_distances.add(self._tick + 1 - remembered[2])
            if parent is None:
                parent = remembered[1]  # e.g. a promotion from the tier below, which lost the link
        if parent is not None and (parent == key or (key in self._orphans and self._is_ancestor(key, parent))):
            parent = None  # a link that would close a cycle (misuse): no tree edge, so no deadlock
        node = _Node(size, parent, self._orphans.pop(key, 0), uses)
        self._nodes[key] = node
        if parent is not None:
            pnode = self._nodes.get(parent)
            if pnode is not None:
                pnode.children += 1
            else:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
        self._touch(key, node)

    def on_access(self, key: str) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        if node.uses > 1:
            self.reuse_distances.add(self._tick + 1 - node.last)
        node.uses += 1
        self._touch(key, node)

    def on_remove(self, key: str) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if node.children:
            self._orphans[key] = node.children
        parent = node.parent
        if parent is not None:
            pnode = self._nodes.get(parent)
            if pnode is not None:
                pnode.children -= 1
                if pnode.children == 0:
                    heapq.heappush(self._heap, (pnode.prio, parent))
            else:
                left = self._orphans.get(parent, 0) - 1
                if left > 0:
                    self._orphans[parent] = left
                else:
                    self._orphans.pop(parent, None)
        if self.ghost_factor > 0:
            self._ghost[key] = (node.uses, parent, node.last)  # appended: a resident key is never in it
            limit = max(MIN_GHOST_ENTRIES, int(self.ghost_factor * len(self._nodes)))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        self._tidy()

    # -- decisions -------------------------------------------------------------------------------
    def victims(self, need_bytes: int, can_evict: Callable[[str], bool]) -> list[str]:
        """Leaves in priority order (a parent joins once all its children are taken); no state change.

        The heap is read through a frontier of indices (the standard ordered walk of a binary heap),
        so nothing is popped; parents that become leaves on the way enter the frontier too.
        """
        heap = self._heap
        nodes = self._nodes
        out: list[str] = []
        if need_bytes <= 0 or not heap:
            return out
        prio, key = heap[0]  # the common case: the top leaf alone is enough
        node = nodes.get(key)
        if (node is not None and node.prio == prio and node.children == 0 and node.size >= need_bytes
                and can_evict(key)):
            return [key]
        taken: set[str] = set()
        left_children: dict[str, int] = {}
        # frontier entries: (prio, key, heap index or -1 for a parent freed during this walk)
        frontier: list[tuple[float, str, int]] = [(heap[0][0], heap[0][1], 0)]
        freed = 0
        n = len(heap)
        while frontier and freed < need_bytes:
            prio, key, idx = heapq.heappop(frontier)
            if idx >= 0:
                for child in (2 * idx + 1, 2 * idx + 2):
                    if child < n:
                        heapq.heappush(frontier, (heap[child][0], heap[child][1], child))
            node = nodes.get(key)
            if node is None or node.prio != prio or key in taken:
                continue
            if left_children.get(key, node.children) > 0:
                continue
            if not can_evict(key):
                continue
            taken.add(key)
            out.append(key)
            freed += node.size
            parent = node.parent
            pnode = nodes.get(parent) if parent is not None else None
            if pnode is not None and parent not in taken:
                remaining = left_children.get(parent, pnode.children) - 1
                left_children[parent] = remaining
                if remaining == 0:
                    heapq.heappush(frontier, (pnode.prio, parent, -1))  # type: ignore[arg-type]
        return out

    def admit(self, key: str, size: int) -> bool:
        return True

    def uses_of(self, key: str) -> int:
        """Requests seen for ``key`` (resident or remembered in the ghost list); 0 when unknown."""
        node = self._nodes.get(key)
        if node is not None:
            return node.uses
        remembered = self._ghost.get(key)
        return 0 if remembered is None else remembered[0]

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    # -- internals -------------------------------------------------------------------------------
    @property
    def horizon(self) -> float:
        """Ticks a reused object stays ahead of fresh ones after its last use."""
        learned = self.reuse_distances.value
        if learned is None:
            return self.initial_turnovers * len(self._nodes) * (self.horizon_scale > 0)
        return self.horizon_scale * learned

    def _touch(self, key: str, node: _Node) -> None:
        self._tick += 1
        node.last = self._tick
        prio = float(self._tick)
        if node.uses > 1:
            prio += self.horizon
        node.prio = prio
        if node.children == 0:
            heapq.heappush(self._heap, (prio, key))
            if len(self._heap) > 2 * len(self._nodes) + 64:
                self._compact()

    def _is_ancestor(self, key: str, start: str) -> bool:
        """Whether ``key`` is on the parent chain above resident ``start`` (only asked for keys that
        already have resident children, which is rare: children put before their parent)."""
        seen = 0
        node = self._nodes.get(start)
        while node is not None and seen <= len(self._nodes):
            if node.parent == key:
                return True
            node = self._nodes.get(node.parent) if node.parent is not None else None
            seen += 1
        return False

    def _tidy(self) -> None:
        """Drop stale heap entries from the top (after an eviction, where the next walk starts)."""
        heap = self._heap
        nodes = self._nodes
        while heap:
            prio, key = heap[0]
            node = nodes.get(key)
            if node is not None and node.prio == prio and node.children == 0:
                break
            heapq.heappop(heap)
        if len(heap) > 2 * len(nodes) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from live leaves once stale entries outnumber them (amortised O(1))."""
        self._heap = [(n.prio, k) for k, n in self._nodes.items() if n.children == 0]
        heapq.heapify(self._heap)


class PrefixLruPolicy(PrefixReusePolicy):
    """Leaf-first LRU over the prefix tree, without reuse protection (a baseline)."""

    name = "prefix_lru"

    def __init__(self) -> None:
        super().__init__(horizon_scale=0.0, initial_turnovers=0.0, ghost_factor=0.0)
