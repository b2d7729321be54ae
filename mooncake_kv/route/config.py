"""``mooncake-kv route``'s config: the instances, the policy, the index, and the estimate's prior.
Read in one place (:func:`load`); every key is in docs/ROUTING.md."""

from __future__ import annotations

import msgspec

from mooncake_connector.costs import Prior
from mooncake_kv.route.decide import POLICIES, ROLES
from store_backend.config import ConfigError, config_from_dict
from store_backend.config_loader import read_file
from store_backend.events.subscriber import SourceConfig


class InstanceConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One engine behind the router: ``name``, its OpenAI-compatible ``url``; ``source``: the
    index source of its KV events (its GPU blocks and the connector's chunks; null: none);
    ``node_source``: the index source of its node service (null: none); ``role``: ``both`` (it
    serves whole requests), ``prefill`` (a ``kv_producer``: prefill legs only) or ``decode`` (a
    ``kv_consumer``: decode legs, and whole requests the router sends it without a prefill leg);
    ``node``: the pool node id of the node service it is attached to (a decode instance's: the
    prefill leg pushes the chunks there as they are stored; null: the decode side pulls them)."""

    name: str
    url: str
    source: str | None = None
    node_source: str | None = None
    role: str = "both"
    node: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("instances: a name must not be empty")
        if self.role not in ROLES:
            raise ValueError(f"instance {self.name!r}: role {self.role!r} is not one of {list(ROLES)}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"instance {self.name!r}: url {self.url!r} is not http(s)://host:port")


class PriorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The estimate before an instance has been observed (seconds; see route/costs.py)."""

    fixed_s: float = 0.02
    per_token_s: float = 1e-4
    per_token2_s: float = 1e-9
    load_s_per_token: dict[str, float] = msgspec.field(default_factory=lambda: {"CPU": 1e-5, "STORAGE": 3e-5,
                                                                                 "REMOTE": 5e-5})

    def prior(self) -> Prior:
        return Prior(self.fixed_s, self.per_token_s, self.per_token2_s, dict(self.load_s_per_token))


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    instances: list[InstanceConfig]
    policy: str = "conductor"
    host: str = "127.0.0.1"
    port: int = 8400
    slo_ttft_s: float | None = None
    # The index: sources subscribed to in this process (mooncake_kv.index), keyed as the connector.
    sources: list[SourceConfig] = msgspec.field(default_factory=list)
    chunk_tokens: int = 256
    hash_scheme: str = "xxh3_128"
    fingerprints: list[str] | None = None
    pool: bool = True
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 900.0
    retries: int = 1
    decisions_kept: int = 10_000
    prior: PriorConfig = msgspec.field(default_factory=PriorConfig)
    # Prefill/decode pools (instances with role prefill or decode): a prefill leg is made only when
    # it can hand over at least this many tokens (null: one chunk); decode instances whose recent
    # time between tokens is over slo_tbt_s take no new request (null: no TBT SLO).
    pd_min_transfer_tokens: int | None = None
    slo_tbt_s: float | None = None
    # The prefill leg names the decode instance's pool node (its `node`), so the chunks are pushed
    # there as they are stored; false: the decode side pulls them after the prefill leg.
    pd_push: bool = True
    # At start, how long the router waits for every instance's /metrics to name its KV layout
    # before it checks that prefill and decode instances can be paired (0: one health check);
    # an instance not read by then is checked when it first answers.
    pd_layout_wait_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.instances:
            raise ValueError("instances: at least one is needed")
        names = [i.name for i in self.instances]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"instances: names must be unique, {dup} repeated")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {list(POLICIES)}")
        if self.slo_ttft_s is not None and self.slo_ttft_s <= 0:
            raise ValueError(f"slo_ttft_s: must be > 0 (null: no SLO), got {self.slo_ttft_s}")
        known = {s.name for s in self.sources}
        for inst in self.instances:
            for field in ("source", "node_source"):
                name = getattr(inst, field)
                if name is not None and name not in known:
                    raise ValueError(f"instance {inst.name!r}: {field} {name!r} is not one of sources {sorted(known)}")
        for field in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "request_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field}: must be > 0, got {getattr(self, field)}")
        if self.unhealthy_after < 1 or self.retries < 0 or self.decisions_kept < 1:
            raise ValueError("unhealthy_after and decisions_kept must be >= 1, retries >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")
        if self.pd:
            roles = {i.role for i in self.instances}
            if not roles & {"prefill", "both"} or not roles & {"decode", "both"}:
                raise ValueError(f"instances: prefill/decode pools need an instance of role prefill (or both) and one "
                                 f"of role decode (or both); the roles are {sorted(roles)}")
        if self.slo_tbt_s is not None and self.slo_tbt_s <= 0:
            raise ValueError(f"slo_tbt_s: must be > 0 (null: no TBT SLO), got {self.slo_tbt_s}")
        if not 0 <= self.pd_layout_wait_s <= 3600:
            raise ValueError(f"pd_layout_wait_s: must be in [0, 3600], got {self.pd_layout_wait_s}")
        if self.pd_min_transfer_tokens is not None and self.pd_min_transfer_tokens < 0:
            raise ValueError(f"pd_min_transfer_tokens: must be >= 0, got {self.pd_min_transfer_tokens}")

    @property
    def pd(self) -> bool:
        """Whether the router runs prefill/decode pools (some instance has role prefill or decode)."""
        return any(i.role != "both" for i in self.instances)

    @property
    def min_transfer_tokens(self) -> int:
        return self.chunk_tokens if self.pd_min_transfer_tokens is None else self.pd_min_transfer_tokens

    @property
    def leaves_rotation_within_s(self) -> float:
        """How long a dead instance can stay in the rotation: ``unhealthy_after`` failed checks,
        each at most an interval plus its timeout (a failed forward takes it out at once)."""
        return self.unhealthy_after * (self.health_interval_s + self.health_timeout_s)


def load(path: str, host: str | None = None, port: int | None = None, policy: str | None = None) -> RouterConfig:
    """The config file (JSON or YAML) with command-line overrides; ConfigError naming what is wrong."""
    data = dict(read_file(path))
    for key, value in (("host", host), ("port", port), ("policy", policy)):
        if value is not None:
            data[key] = value
    try:
        return config_from_dict(data, RouterConfig)
    except ConfigError as e:
        raise ConfigError(f"{e} (from config file {path})") from None
