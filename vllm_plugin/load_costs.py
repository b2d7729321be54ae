"""Load or recompute (``load_policy: cost``): which leading chunks of a hit are worth loading. Pure.

A cached chunk is worth loading only when loading it is faster than computing it again. The
scheduler learns both from what it observes:

- **compute**: each step's duration (from building its metadata to its output coming back) against
  the tokens it scheduled (steps that load are left out: they wait for their loads), fitted with
  the router's cost model (:class:`mooncake_connector.costs.CostModel`: a fixed cost per step plus
  ``per_token_s``, the engine's prefill speed);
- **loads**: each rank's load jobs (read from the store, by the tier each chunk was pinned in, until
  ready) against their tokens per tier: a load time per token for ``CPU`` (the DRAM tier),
  ``STORAGE`` (SSD) and ``REMOTE`` (the pool), the decayed seconds over the decayed tokens of each
  (a job of several tiers split by their costs so far).

:meth:`LoadCosts.loadable` keeps the leading chunks up to the first whose tier loads a token slower
than the engine computes one (a match is a prefix: a slow tier shortens it, it never punches holes
in it). Until a tier has :data:`MIN_LOADS` load jobs and the engine :data:`MIN_STEPS` steps of
prefill, every chunk is loaded (``load_policy: always`` always does). Scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mooncake_connector.costs import MEDIA_LOADED, CostModel, Prior

TIER_MEDIUM = {"dram": "CPU", "ssd": "STORAGE", "pool": "REMOTE"}
MIN_LOADS = 3
MIN_STEPS = 3
MIN_STEP_TOKENS = 16  # steps with fewer scheduled tokens (decode) say little of the prefill speed


class LoadCosts:
    def __init__(self, *, decay: float = 0.98) -> None:
        self._compute = CostModel(Prior(fixed_s=0.0, per_token_s=1e-4, per_token2_s=0.0, load_s_per_token={}),
                                  prior_weight=1.0)
        self._decay = decay
        self._load_s = dict.fromkeys(MEDIA_LOADED, 0.0)  # decayed seconds attributed to each medium
        self._load_tokens = dict.fromkeys(MEDIA_LOADED, 0.0)  # and its decayed tokens
        self.load_jobs = dict.fromkeys(MEDIA_LOADED, 0)
        self.steps = 0

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One step's ``tokens`` scheduled (all requests) took ``seconds``."""
        if tokens >= MIN_STEP_TOKENS and seconds > 0:
            self._compute.observe(tokens, {}, seconds)
            self.steps += 1

    def observe_load(self, tokens_by_tier: Mapping[str, int], seconds: float) -> None:
        """One load job read ``tokens_by_tier`` (store tier name -> tokens) in ``seconds``. A job
        of several tiers is split between them by their tokens times their cost so far (by tokens
        alone while none is known)."""
        by_medium: dict[str, int] = {}
        for tier, n in tokens_by_tier.items():
            m = TIER_MEDIUM.get(tier)
            if m is not None and n > 0:
                by_medium[m] = by_medium.get(m, 0) + n
        if not by_medium or seconds <= 0:
            return
        weights = {m: n * (self._per_token(m) or 0.0) for m, n in by_medium.items()}
        if sum(weights.values()) <= 0:
            weights = {m: float(n) for m, n in by_medium.items()}
        total = sum(weights.values())
        for m, n in by_medium.items():
            self._load_s[m] = self._decay * self._load_s[m] + seconds * weights[m] / total
            self._load_tokens[m] = self._decay * self._load_tokens[m] + n
            self.load_jobs[m] += 1

    def _per_token(self, medium: str) -> float | None:
        return self._load_s[medium] / self._load_tokens[medium] if self._load_tokens[medium] > 0 else None

    def compute_s_per_token(self) -> float | None:
        """The engine's measured prefill time per token (None until :data:`MIN_STEPS` steps)."""
        return self._compute.coefficients()["per_token_s"] if self.steps >= MIN_STEPS else None

    def load_s_per_token(self, tier: str) -> float | None:
        """The measured load time per token from ``tier`` (None until :data:`MIN_LOADS` jobs)."""
        m = TIER_MEDIUM.get(tier)
        if m is None or self.load_jobs[m] < MIN_LOADS:
            return None
        return self._per_token(m)

    def loadable(self, tiers: Sequence[str | None]) -> int:
        """How many leading chunks of a hit (the tier each is in, in order) to load: up to the first
        whose tier is measured slower per token than computing (unmeasured tiers are loaded)."""
        compute = self.compute_s_per_token()
        if compute is None:
            return len(tiers)
        for i, tier in enumerate(tiers):
            load = self.load_s_per_token(tier or "")
            if load is not None and load > compute:
                return i
        return len(tiers)

    def measured(self) -> dict[str, float]:
        """Seconds per token measured so far, by tier name and ``compute`` (only those measured):
        the connector's gauge ``mooncake_kv_connector_cost_per_token_seconds``, which a router reads."""
        out = {t: v for t in TIER_MEDIUM if (v := self.load_s_per_token(t)) is not None}
        compute = self.compute_s_per_token()
        if compute is not None:
            out["compute"] = compute
        return out

    def stats(self) -> dict[str, float | int | None]:
        return {"compute_s_per_token": self.compute_s_per_token(), "steps": self.steps,
                **{f"load_s_per_token_{t}": self.load_s_per_token(t) for t in TIER_MEDIUM},
                **{f"load_jobs_{t}": self.load_jobs[m] for t, m in TIER_MEDIUM.items()}}
