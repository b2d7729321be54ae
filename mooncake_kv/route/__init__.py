"""The Conductor: a cache-aware router in front of vLLM (and SGLang) instances."""
