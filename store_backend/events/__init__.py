"""KV events: what the store holds, published for routers in vLLM's own wire format.

``wire`` is the format (vLLM 0.32's ``KVEventBatch`` and its events, encoded without importing
vLLM), ``translate`` turns the store's residency events into it (pure), and ``publisher`` is the
ZMQ publisher a node service runs (PUB for the stream, ROUTER for replay and snapshots).
"""
