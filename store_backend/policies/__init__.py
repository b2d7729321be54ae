"""Eviction and admission policies: pure decision code behind the Protocols in ``base.py`` and
``admission.py``; names map to policies in ``registry.py``."""
