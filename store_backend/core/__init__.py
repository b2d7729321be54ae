"""The embedded store's sections, one job per module, composed by :class:`store_backend.store.TieredStore`.

Each module is a mixin class over the store's one state: the attributes ``TieredStore.__init__``
sets (the DRAM tier and its index, the tiers below, the slot table, the trackers of
:mod:`store_backend.coherence`, the counters, the workers), guarded by its one lock
(``_lock``, with the conditions ``_changed``, ``_slot_changed`` and ``_room`` on it). No section
adds a lock or state of its own; a method marked "(lock held)" is called with that lock held,
and no tier below DRAM is ever called under it.

- :mod:`.writes`: put, DRAM room (eviction by policy, the wait for the offload), commits.
- :mod:`.slot_calls`: reserve/commit/abort, lease/release, stage-in, expiry and reclaim.
- :mod:`.reads`: get_into, DRAM first then each tier below; replicas of other nodes' objects.
- :mod:`.fill`: the one fill primitive (locate below, fill DRAM slots, commit) and promotion.
- :mod:`.queries`: contains/exists/tier_of/keys/size_of, each tier asked outside the lock.
- :mod:`.removal` and :mod:`.pins`: remove, pins and the unpins owed to removed entries.
- :mod:`.offload` and :mod:`.flush`: the one offload queue, SSD writes, demotion, flush.
- :mod:`.stats`: counters and gauges.
- :mod:`.common`: the bounds and helpers they share.

The rule "ask a lower tier outside the lock, re-check under it after" is one helper,
:class:`store_backend.coherence.Ticket` (``TieredStore._ticket``).
"""
