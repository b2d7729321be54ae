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

An object's priority is the tick of its last insert or hit, plus the horizon if it has been
reused (the horizon as it is when the decision is taken); the leaf with the smallest priority is
evicted first. Within each of the two classes (fresh, reused) that is least-recently-used order, so
each class keeps its leaves in an insertion-ordered dict (O(1) for the usual arrivals at the young
end, and for a parent that becomes a leaf when its last child, the oldest leaf, leaves), with a
small heap for the few leaves that arrive out of order. Every operation is O(1) in the common case
and O(log n) at worst; ``victims`` reads the queues without changing them.

Pure decision code (see ``base.py``): the owning tier calls it under its lock; not thread-safe.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

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


_QUEUED_NOT = 0  # not a leaf: in no queue
_QUEUED_ORDER = 1  # in its class's ordered dict
_QUEUED_HEAP = 2  # in its class's heap (entries of nodes that left it are skipped lazily)


class _Node:
    __slots__ = ("children", "last", "parent", "queued", "size", "uses")

    def __init__(self, size: int, parent: str | None, children: int, uses: int) -> None:
        self.size = size
        self.parent = parent
        self.children = children  # resident children
        self.uses = uses  # requests seen: the insert, every hit, and uses remembered from the ghost
        self.last = 0  # tick of the last insert or hit
        self.queued = _QUEUED_NOT


class _LeafQueue:
    """The leaves of one class by last-use tick: an ordered dict (key -> tick, oldest first) for
    leaves that arrive in order, a heap of (tick, key) for those that do not."""

    __slots__ = ("heap", "newest", "order")

    def __init__(self) -> None:
        self.order: OrderedDict[str, int] = OrderedDict()
        self.heap: list[tuple[int, str]] = []
        # Never below the tick at the end of ``order``: a leaf at least this young can be appended
        # and ``order`` stays sorted.
        self.newest = 0


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
        self._queues = (_LeafQueue(), _LeafQueue())  # leaves of fresh (uses == 1), reused (uses > 1)
        # evicted key -> (uses, parent, tick of its last use)
        self._ghost: OrderedDict[str, tuple[int, str | None, int]] = OrderedDict()
        self._tick = 0

    # -- events from the tier --------------------------------------------------------------------
    def on_insert(self, key: str, size: int, parent: str | None = None) -> None:
        nodes = self._nodes
        if key in nodes:  # re-insert of a resident key: treat as a use
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
        nodes[key] = node
        if parent is not None:
            pnode = nodes.get(parent)
            if pnode is not None:
                if pnode.children == 0:
                    self._unqueue(parent, pnode)
                pnode.children += 1
            else:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
        self._tick += 1
        node.last = self._tick
        if node.children == 0:
            q = self._queues[uses > 1]
            q.order[key] = q.newest = self._tick  # the youngest: at the end
            node.queued = _QUEUED_ORDER

    def on_access(self, key: str) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        if node.uses > 1:
            self.reuse_distances.add(self._tick + 1 - node.last)
        if node.queued:
            self._unqueue(key, node)
        node.uses += 1
        self._tick += 1
        node.last = self._tick
        if node.children == 0:
            q = self._queues[1]
            q.order[key] = q.newest = self._tick
            node.queued = _QUEUED_ORDER

    def on_remove(self, key: str) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if node.queued == _QUEUED_ORDER:
            del self._queues[node.uses > 1].order[key]
        if node.children:
            self._orphans[key] = node.children
        parent = node.parent
        if parent is not None:
            pnode = self._nodes.get(parent)
            if pnode is not None:
                pnode.children -= 1
                if pnode.children == 0:
                    self._enqueue(parent, pnode)
            else:
                left = self._orphans.get(parent, 0) - 1
                if left > 0:
                    self._orphans[parent] = left
                else:
                    self._orphans.pop(parent, None)
        if self.ghost_factor > 0:
            ghost = self._ghost
            ghost[key] = (node.uses, parent, node.last)  # appended: a resident key is never in it
            limit = max(MIN_GHOST_ENTRIES, int(self.ghost_factor * len(self._nodes)))
            while len(ghost) > limit:
                ghost.popitem(last=False)

    # -- decisions -------------------------------------------------------------------------------
    def victims(self, need_bytes: int, can_evict: Callable[[str], bool]) -> list[str]:
        """Leaves in priority order (a parent joins once all its children are taken); no state change."""
        out: list[str] = []
        if need_bytes <= 0 or not self._nodes:
            return out
        horizon = self.horizon
        nodes = self._nodes
        qf, qr = self._queues
        if qf.heap or qr.heap:
            fresh, reused = self._head(0), self._head(1)
        else:  # the usual state: both classes entirely in order
            f = next(iter(qf.order.items()), None)
            r = next(iter(qr.order.items()), None)
            fresh = None if f is None else (f[1], f[0])
            reused = None if r is None else (r[1], r[0])
        best = fresh if reused is None or (fresh is not None and fresh[0] <= reused[0] + horizon) else reused
        if best is not None:  # the common case: the oldest leaf alone is enough
            node = nodes[best[1]]
            if node.size >= need_bytes and can_evict(best[1]):
                return [best[1]]
        stream = heapq.merge(self._ordered(0, 0.0), self._ordered(1, horizon))
        ahead = next(stream, None)
        freed_parents: list[tuple[float, str]] = []  # parents whose children this walk took
        taken: set[str] = set()
        left_children: dict[str, int] = {}
        freed = 0
        while freed < need_bytes:
            if freed_parents and (ahead is None or freed_parents[0] < ahead):
                _prio, key = heapq.heappop(freed_parents)
            elif ahead is not None:
                key = ahead[1]
                ahead = next(stream, None)
            else:
                break
            node = nodes[key]
            if key in taken or left_children.get(key, node.children) > 0 or not can_evict(key):
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
                    heapq.heappush(freed_parents, (pnode.last + (horizon if pnode.uses > 1 else 0.0), parent))
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

    def bookkeeping(self) -> dict[str, int]:
        """Entries the policy holds besides its resident objects (what bounds its memory):
        ``fresh_heap`` and ``reused_heap`` (out-of-order leaves, stale ones included until
        compacted) and ``ghost`` (remembered evicted keys)."""
        qf, qr = self._queues
        return {"fresh_heap": len(qf.heap), "reused_heap": len(qr.heap), "ghost": len(self._ghost)}

    # -- internals -------------------------------------------------------------------------------
    @property
    def horizon(self) -> float:
        """Ticks a reused object stays ahead of fresh ones after its last use."""
        learned = self.reuse_distances.value
        if learned is None:
            return self.initial_turnovers * len(self._nodes) * (self.horizon_scale > 0)
        return self.horizon_scale * learned

    def _enqueue(self, key: str, node: _Node) -> None:
        """Queue a node that has just become a leaf, at its last-use tick."""
        q = self._queues[node.uses > 1]
        order = q.order
        tick = node.last
        if not order or tick >= q.newest:
            order[key] = q.newest = tick
            node.queued = _QUEUED_ORDER
        elif tick <= order[next(iter(order))]:  # e.g. the parent of the oldest leaf, just evicted
            order[key] = tick
            order.move_to_end(key, last=False)
            node.queued = _QUEUED_ORDER
        else:
            heapq.heappush(q.heap, (tick, key))
            node.queued = _QUEUED_HEAP
            if len(q.heap) > 2 * len(self._nodes) + 64:
                self._compact()

    def _unqueue(self, key: str, node: _Node) -> None:
        if node.queued == _QUEUED_ORDER:
            del self._queues[node.uses > 1].order[key]
        node.queued = _QUEUED_NOT  # a heap entry is left behind and skipped when met

    def _live(self, tick: int, key: str, cls: int) -> bool:
        node = self._nodes.get(key)
        return node is not None and node.queued == _QUEUED_HEAP and node.last == tick and (node.uses > 1) == cls

    def _head(self, cls: int) -> tuple[int, str] | None:
        """(tick, key) of the oldest leaf of a class; drops dead entries from the top of its heap."""
        q = self._queues[cls]
        heap = q.heap
        while heap and not self._live(heap[0][0], heap[0][1], cls):
            heapq.heappop(heap)
        first = next(iter(q.order.items()), None)
        if first is not None and (not heap or first[1] <= heap[0][0]):
            return first[1], first[0]
        return heap[0] if heap else None

    def _ordered(self, cls: int, offset: float) -> Iterator[tuple[float, str]]:
        """The leaves of a class as (priority, key), lowest first, without changing anything."""
        q = self._queues[cls]
        in_order = ((tick + offset, key) for key, tick in q.order.items())
        return heapq.merge(in_order, self._heap_in_order(q.heap, cls, offset))

    def _heap_in_order(self, heap: list[tuple[int, str]], cls: int, offset: float) -> Iterator[tuple[float, str]]:
        """Live heap entries in order: the standard walk of a binary heap through a frontier of indices."""
        frontier = [(heap[0][0], 0)] if heap else []
        n = len(heap)
        while frontier:
            _tick, idx = heapq.heappop(frontier)
            for child in (2 * idx + 1, 2 * idx + 2):
                if child < n:
                    heapq.heappush(frontier, (heap[child][0], child))
            tick, key = heap[idx]
            if self._live(tick, key, cls):
                yield tick + offset, key

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

    def _compact(self) -> None:
        """Rebuild the heaps from their live entries once dead ones outnumber them (amortised O(1))."""
        for cls, q in enumerate(self._queues):
            q.heap = [(t, k) for t, k in q.heap if self._live(t, k, cls)]
            heapq.heapify(q.heap)


class PrefixLruPolicy(PrefixReusePolicy):
    """Leaf-first LRU over the prefix tree, without reuse protection (a baseline)."""

    name = "prefix_lru"

    def __init__(self) -> None:
        super().__init__(horizon_scale=0.0, initial_turnovers=0.0, ghost_factor=0.0)
