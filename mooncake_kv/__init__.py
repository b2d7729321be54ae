"""The ``mooncake-kv`` application: the console script, demo, benchmarks, trace replay and inspect.

The top layer: it may import the plugins (``vllm_plugin``, ``sglang_hicache``), the engine-agnostic
core (``mooncake_connector``) and the store (``store_backend``); none of those import it
(import-linter contracts in ``pyproject.toml``, checked by ``tests/test_import_layers.py``).
"""
