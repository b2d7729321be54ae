"""Tools for tests, benchmarks and examples; production code (the store, the core, the plugins)
never imports them (an import-linter contract in ``pyproject.toml``).

``sglang_cpu``: importing SGLang's storage classes on a CPU-only torch. ``llama``: a Llama
``config.json`` for vLLM's dummy weights.
"""
