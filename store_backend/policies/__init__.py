"""Eviction and admission policies: pure decision code behind the Protocols in ``base.py``.

The prefix-aware policies are registered here so that every way into the package
(``make_policy``, a config naming them) finds them.
"""

from __future__ import annotations

from store_backend.policies.prefix_reuse import PrefixLruPolicy, PrefixReusePolicy
from store_backend.policies.registry import register_policy

register_policy(PrefixReusePolicy.name, PrefixReusePolicy)
register_policy(PrefixLruPolicy.name, PrefixLruPolicy)
