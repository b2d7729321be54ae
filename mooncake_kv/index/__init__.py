"""``mooncake-kv index``: what every engine and node service caches, from their KV events, and how
much of a prompt each one holds (``state`` the pure index, ``subscriber`` the ZMQ side,
``service`` the HTTP API)."""
