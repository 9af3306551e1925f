"""What admission checks a request against, and what it keys the request with."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.auth import KeyRing, Tenant
from gateway.config import LimitsConfig
from gateway.keying import Keying
from gateway.quotas import TenantLimiter
from gateway.registry import Pool
from gateway.responses_affinity import ResponseAffinity


@dataclass(slots=True)
class Gate:
    """The admission side of the process (`gateway.admission`): the tenants' keys, the
    gateway-wide limits, each tenant's limiter, the served models (the registry's own map), the
    keying of prompts and, for Responses follow-ups, which worker holds each stored response."""

    keyring: KeyRing
    limits: LimitsConfig
    limiters: dict[str, TenantLimiter]
    models: dict[str, Pool]  # served model id -> its pool
    keying: Keying
    responses: ResponseAffinity

    def limiter(self, tenant: Tenant) -> TenantLimiter:
        return self.limiters[tenant.name]
