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
  evicted, remembered in a bounded ghost list) stays ahead of fresh chunks for
  ``protect_turnovers`` cache turnovers since its last use.

Each object has one static priority, refreshed on every insert or hit:
``tick + protect_turnovers * resident_objects`` for reused objects and ``tick`` for fresh ones, where
``tick`` counts inserts and hits. The leaf with the smallest priority is evicted first. Leaves sit in
a binary heap with lazy invalidation, so every operation costs O(log n); ``victims`` walks the heap
without changing it.

Pure decision code (see ``base.py``): the owning tier calls it under its lock; not thread-safe.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

# A reused object outranks fresh ones for this many cache turnovers after its last use.
DEFAULT_PROTECT_TURNOVERS = 8
# Evicted keys remembered (their use count and parent), as a multiple of the resident objects.
DEFAULT_GHOST_FACTOR = 4
MIN_GHOST_ENTRIES = 1024


class _Node:
    __slots__ = ("size", "parent", "children", "uses", "prio")

    def __init__(self, size: int, parent: str | None, children: int, uses: int) -> None:
        self.size = size
        self.parent = parent
        self.children = children  # resident children
        self.uses = uses  # requests seen: the insert, every hit, and uses remembered from the ghost
        self.prio = 0


class PrefixReusePolicy:
    """Leaf-first eviction of the prefix tree; reused objects outrank fresh ones (see module doc).

    ``protect_turnovers=0`` gives plain leaf-first LRU. ``ghost_factor`` bounds the ghost list of
    evicted keys at that many times the resident objects (at least ``MIN_GHOST_ENTRIES``).
    """

    name = "prefix_reuse"

    def __init__(
        self,
        protect_turnovers: float = DEFAULT_PROTECT_TURNOVERS,
        ghost_factor: float = DEFAULT_GHOST_FACTOR,
    ) -> None:
        if protect_turnovers < 0:
            raise ValueError(f"protect_turnovers must be >= 0, got {protect_turnovers}")
        if ghost_factor < 0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self.protect_turnovers = protect_turnovers
        self.ghost_factor = ghost_factor
        self._nodes: dict[str, _Node] = {}
        # Resident children of keys that are not resident themselves (inserted before their parent,
        # or left behind by an explicit remove of the parent).
        self._orphans: dict[str, int] = {}
        self._heap: list[tuple[float, str]] = []  # (prio, key) of leaves; stale entries skipped
        self._ghost: OrderedDict[str, tuple[int, str | None]] = OrderedDict()  # key -> (uses, parent)
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
            if parent is None:
                parent = remembered[1]  # e.g. a promotion from the tier below, which lost the link
        if parent == key:
            parent = None
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
            self._ghost[key] = (node.uses, parent)
            self._ghost.move_to_end(key)
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
    def _touch(self, key: str, node: _Node) -> None:
        self._tick += 1
        prio: float = self._tick
        if node.uses > 1 and self.protect_turnovers:
            prio += self.protect_turnovers * len(self._nodes)
        node.prio = prio
        if node.children == 0:
            heapq.heappush(self._heap, (prio, key))
        self._tidy()

    def _valid(self, entry: tuple[float, str]) -> bool:
        node = self._nodes.get(entry[1])
        return node is not None and node.prio == entry[0] and node.children == 0

    def _tidy(self) -> None:
        """Drop stale heap entries from the top, and rebuild when stale ones outnumber live ones."""
        heap = self._heap
        while heap and not self._valid(heap[0]):
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._nodes) + 64:
            live = {k: n for k, n in self._nodes.items() if n.children == 0}
            self._heap = [(n.prio, k) for k, n in live.items()]
            heapq.heapify(self._heap)


class PrefixLruPolicy(PrefixReusePolicy):
    """Leaf-first LRU over the prefix tree, without reuse protection (a baseline)."""

    name = "prefix_lru"

    def __init__(self) -> None:
        super().__init__(protect_turnovers=0, ghost_factor=0)
