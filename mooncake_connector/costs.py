"""What a request costs on an instance, learned from what is observed. Pure. The router fits one per
instance (``mooncake_kv.route``); the vLLM connector fits its own loads and steps with it
(``vllm_plugin.load_costs``).

One :class:`CostModel` per instance predicts the time from sending a request to its first token
when nothing is queued ahead of it (the instance's *service time*):

    service_s = c0 + c1 * new + c2 * new * (prefix + new) + sum over media m of d_m * cached_m

``new``: prompt tokens the instance computes; ``prefix``: tokens it loads instead; ``cached_m``:
those loaded from medium ``m`` (``CPU``, ``STORAGE``, ``REMOTE``; ``GPU`` costs nothing). The
quadratic term is attention over the context; the per-medium terms are the load time of a token's
KV from each tier (1 / the tier's effective bandwidth in tokens/s). The coefficients are a ridge
regression fitted online to observed service times, weighted by relative error (1/y^2), pulled
towards a prior (:class:`Prior`) with the weight of ``prior_weight`` average observations, with
older observations decayed (``forget``), so a model with no data predicts the prior and one with
data follows the instance. Coefficients are kept non-negative.

Queue time (:func:`queue_s`) is what the requests already sent there and not yet at their first
token will take, by their own predictions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MEDIA_LOADED = ("CPU", "STORAGE", "REMOTE")  # GPU blocks cost nothing to reuse
# Feature scales (tokens in thousands, the quadratic term in millions): keeps the normal equations
# well conditioned.
_SCALE = np.array([1.0, 1e-3, 1e-6, 1e-3, 1e-3, 1e-3])


@dataclass(frozen=True)
class Prior:
    """Seconds: ``fixed_s`` per request, ``per_token_s`` per computed token, ``per_token2_s`` per
    computed token and context token, ``load_s_per_token`` per medium loaded from."""

    fixed_s: float = 0.02
    per_token_s: float = 1e-4
    per_token2_s: float = 1e-9
    load_s_per_token: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1e-5, "STORAGE": 3e-5,
                                                                            "REMOTE": 5e-5})

    def vector(self) -> np.ndarray:
        raw = [self.fixed_s, self.per_token_s, self.per_token2_s] + [self.load_s_per_token.get(m, 0.0)
                                                                     for m in MEDIA_LOADED]
        return np.array(raw) / _SCALE

    @classmethod
    def from_bandwidth(cls, *, prefill_tokens_per_s: float, fixed_s: float, kv_bytes_per_token: float,
                       bandwidth_bytes_per_s: Mapping[str, float], per_token2_s: float = 0.0) -> Prior:
        """A prior from an engine's prefill speed and each tier's bandwidth (bytes/s)."""
        return cls(fixed_s=fixed_s, per_token_s=1.0 / prefill_tokens_per_s, per_token2_s=per_token2_s,
                   load_s_per_token={m: kv_bytes_per_token / bw for m, bw in bandwidth_bytes_per_s.items() if bw > 0})


def features(new: int, cached: Mapping[str, int]) -> np.ndarray:
    """The regression's features of a request: ``new`` computed tokens, ``cached`` tokens by medium."""
    prefix = sum(cached.values())
    return np.array([1.0, new, new * (prefix + new)] + [cached.get(m, 0) for m in MEDIA_LOADED]) * _SCALE


class CostModel:
    """Service time of one instance, fitted online (see the module docstring). Not thread-safe."""

    def __init__(self, prior: Prior | None = None, *, prior_weight: float = 5.0, forget: float = 0.995) -> None:
        if prior_weight <= 0 or not 0 < forget <= 1:
            raise ValueError(f"prior_weight must be > 0 and forget in (0, 1], got {prior_weight}, {forget}")
        self.prior = prior or Prior()
        self._theta0 = self.prior.vector()
        self._prior_weight = prior_weight
        self._forget = forget
        self._xtx = np.zeros((len(self._theta0), len(self._theta0)))
        self._xty = np.zeros(len(self._theta0))
        self._n = 0.0  # observations, decayed as they are
        self._theta = self._theta0.copy()
        self._fixed: dict[int, float] = {}  # feature index -> coefficient measured elsewhere (scaled)
        self.observations = 0

    def set_load_costs(self, s_per_token: Mapping[str, float]) -> None:
        """Load costs per token measured elsewhere (the connector's own, by medium): they replace
        the fitted ones for those media, in predictions and in what the fit attributes to the rest."""
        for m, v in s_per_token.items():
            if m in MEDIA_LOADED and v >= 0:
                i = 3 + MEDIA_LOADED.index(m)
                self._fixed[i] = v / _SCALE[i]

    def _theta_now(self) -> np.ndarray:
        if not self._fixed:
            return self._theta
        theta = self._theta.copy()
        for i, v in self._fixed.items():
            theta[i] = v
        return theta

    def predict(self, new: int, cached: Mapping[str, int]) -> float:
        return max(0.0, float(features(new, cached) @ self._theta_now()))

    def observe(self, new: int, cached: Mapping[str, int], service_s: float) -> None:
        """One observed service time (first token minus send, minus the queue time predicted then)."""
        x = features(new, cached)
        for i, v in self._fixed.items():  # the measured loads' share is not the fit's to explain
            service_s -= x[i] * v
            x[i] = 0.0
        service_s = max(service_s, 1e-4)
        # Relative errors count: each observation weighs 1/y^2 (a 5% miss on a short prompt matters
        # as much as on a long one).
        w = 1.0 / max(service_s, 1e-3) ** 2
        self._xtx = self._forget * self._xtx + w * np.outer(x, x)
        self._xty = self._forget * self._xty + w * x * service_s
        self._n = self._forget * self._n + 1.0
        # The prior weighs as prior_weight average observations, coefficient by coefficient.
        reg = np.diag(self._prior_weight * np.diag(self._xtx) / self._n + 1e-12)
        self._theta = np.maximum(np.linalg.solve(self._xtx + reg, self._xty + reg @ self._theta0), 0.0)
        self.observations += 1

    def coefficients(self) -> dict[str, float]:
        """The fitted coefficients in seconds (per token, per token of context, per token loaded)."""
        t = self._theta_now() * _SCALE
        return {"fixed_s": float(t[0]), "per_token_s": float(t[1]), "per_token2_s": float(t[2]),
                **{f"load_s_per_token_{m}": float(v) for m, v in zip(MEDIA_LOADED, t[3:])}}


@dataclass(frozen=True)
class Pending:
    """A request sent to an instance that has not produced its first token: when it was sent and
    its predicted service time."""

    sent_s: float
    service_s: float


def queue_s(pending: Sequence[Pending], now_s: float) -> float:
    """Time until an instance is through the requests ``pending`` there, if it serves them one
    after the other in the order sent: each one's predicted service time, the oldest's minus what
    it has had (an engine batches prefills, so this is an upper estimate)."""
    if not pending:
        return 0.0
    ordered = sorted(pending, key=lambda p: p.sent_s)
    first = ordered[0]
    return max(0.0, first.service_s - (now_s - first.sent_s)) + sum(p.service_s for p in ordered[1:])


def service_observed(sent_s: float, first_token_s: float, previous_first_token_s: float) -> float:
    """A request's service time as a router can tell it: from when it was sent, or from the
    instance's previous first token if that came later (the instance was busy until then), to its
    own first token. Exact for an instance that serves prefills one at a time; an engine that
    batches prefills overlaps them, which this counts as service of the later one."""
    return max(1e-4, first_token_s - max(sent_s, previous_first_token_s))
