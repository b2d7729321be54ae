"""Benchmarks behind ``mooncake-kv bench``: ``store`` (tiers against memcpy and raw O_DIRECT, the
latter measured by ``raw_direct``), ``vllm`` (TTFT on the vLLM CPU build), ``sglang`` (the HiCache
backend against SGLang's file backend)."""
