"""The admin API: process status and an immediate policy reload, for operators only.

Both routes need `Authorization: Bearer <admin key>`, checked against `admin.api_key_hash` in the
config (the same keyed hash as tenant keys; a tenant key never works here). Without that setting
there are no admin routes: every method on them answers the gateway's 404, as for any unknown
path. Wrong keys are counted per client address (`gateway.admin_throttle`): past a few in a
minute, that address's admin requests get 429 until its minute ends, whatever key they carry.
Nothing here shows request content: workers, context windows,
breakers, scrape ages, KV-event stream counters, policy counters and the policy file's state.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin_throttle import AdminAuthThrottle, Throttled, address_key
from gateway.auth import hash_api_key
from gateway.errors import ApiError
from gateway.log_throttle import LogThrottle
from gateway.policy_watch import PolicyStatus, PolicyWatcher, ReloadResult
from gateway.registry import Pool
from gateway.request_head import request_id_of
from gateway.state import GatewayState
from gateway.surface import error
from gateway.worker import Worker
from policies.stats import SupportsStats

if TYPE_CHECKING:
    from gateway.fleet import Fleet

log = logging.getLogger("kvgate.admin")


def admin_routes(
    state: GatewayState, watcher: PolicyWatcher | None, throttle: AdminAuthThrottle | None = None
) -> list[Route]:
    """`GET /admin/status` and `POST /admin/policy/reload` over the gateway's state; none
    without an admin key. `throttle` counts wrong keys per client address (a new one, on the
    monotonic clock, unless a test brings its own)."""
    if state.config.admin.api_key_hash is None:
        return []
    guard = _KeyCheck(state, throttle if throttle is not None else AdminAuthThrottle())

    async def status(request: Request) -> Response:
        denied = guard.check(request)
        if denied is not None:
            return denied
        return _json(status_snapshot(state, watcher), 200)

    async def reload(request: Request) -> Response:
        denied = guard.check(request)
        if denied is not None:
            return denied
        if watcher is None:
            err = ApiError(409, "no policy_file is configured: nothing to reload", "invalid_request_error")
            return error(dataclasses.replace(err, code="no_policy_file"), request_id_of(request))
        result = await watcher.reload_now()
        return _json(_reload_body(result), 200 if result.error is None else 422)

    return [
        Route("/admin/status", status, methods=["GET"]),
        Route("/admin/policy/reload", reload, methods=["POST"]),
    ]


class _KeyCheck:
    """The admin key on one request: 429 while its address is throttled (the key unread), 401
    without the key, None with it. Only a key that was compared counts as a wrong one: a request
    without a key, or with two, tells its sender nothing about the admin key."""

    def __init__(self, state: GatewayState, throttle: AdminAuthThrottle) -> None:
        expected = state.config.admin.api_key_hash
        assert expected is not None  # no routes without it
        self._expected = expected
        self._secret = state.secret
        self._throttle = throttle
        failures = state.routing.metrics.admin_auth_failures
        self._wrong_key = failures.labels("wrong_key")
        self._throttled = failures.labels("throttled")
        # One line per address per window; as many addresses remembered as the throttle keeps.
        self._log = LogThrottle(log, throttle.window_s, throttle.max_addresses)

    def check(self, request: Request) -> Response | None:
        address = address_key(request.client.host if request.client is not None else None)
        refused = self._throttle.refusal(address)
        if refused is not None:
            self._throttled.inc()
            return error(_throttled(refused), request_id_of(request))
        values = request.headers.getlist("authorization")
        if len(values) > 1:  # two keys in one head: neither is taken (as on the tenants' routes)
            return error(_NO_ADMIN_KEY, request_id_of(request))
        scheme, _, key = (values[0] if values else "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return error(_NO_ADMIN_KEY, request_id_of(request))
        if hmac.compare_digest(hash_api_key(self._secret, key), self._expected):
            return None
        self._wrong_key.inc()
        if self._throttle.failed(address):
            throttle = self._throttle
            self._log.warning(
                address,
                throttle.clock(),
                "admin API: %d wrong admin keys from %s within %.0f s: its admin requests are"
                " answered 429 until its window ends",
                throttle.max_failures,
                address or "an unknown address",
                throttle.window_s,
                extra={"client_address": address},
            )
        return error(_NO_ADMIN_KEY, request_id_of(request))


_NO_ADMIN_KEY = ApiError(401, "admin key required", "invalid_request_error", "invalid_api_key")


def _throttled(refused: Throttled) -> ApiError:
    return ApiError(
        429,
        f"too many wrong admin keys from this address: try again in {refused.retry_after_s} s",
        "rate_limit_error",
        "admin_auth_throttled",
        None,
        {"retry-after": str(refused.retry_after_s)},
    )


def _reload_body(result: ReloadResult) -> dict[str, Any]:
    body: dict[str, Any] = {
        "swapped": result.swapped,
        "unchanged": result.unchanged,
        "policy_file": _policy_status(result.status),
    }
    if result.error is not None:
        # The running policy stays; say why the file was refused.
        body["error"] = {
            "message": f"policy file refused, the running policy stays: {result.error}",
            "type": "invalid_request_error",
            "param": None,
            "code": "policy_rejected",
        }
    return body


def status_snapshot(state: GatewayState, watcher: PolicyWatcher | None) -> dict[str, Any]:
    """Everything `GET /admin/status` reports, as plain JSON-able data."""
    now_s = time.monotonic()
    fleet = state.fleet
    pools = []
    for pool in state.registry.pools.values():
        workers = [_worker(w, now_s, pool, fleet) for w in pool.workers.values()]
        pools.append(
            {
                "name": pool.name,
                "models": list(pool.config.models),
                "max_model_len": _windows(pool),
                "workers": workers,
            }
        )
    return {
        # Under `kvgate serve --processes N` this answer is one process's (the kernel picked it).
        "process": {"pid": os.getpid(), "index": state.lifecycle.group.index},
        "ready": state.lifecycle.ready,
        "draining": state.lifecycle.draining,
        "uptime_s": round(time.time() - state.created_s, 1),
        "active_streams": len(state.lifecycle.active_streams),
        "pools": pools,
        "policy": _policy(state, watcher),
    }


def _windows(pool: Pool) -> dict[str, dict[str, Any]]:
    """Each model's context window as admission uses it, and where it comes from: the pool's
    config, its workers' cards, or nowhere yet (then nothing is refused for it)."""
    source = "config" if pool.windows.stated else "workers"
    known = pool.windows.max_model_len
    unknown: dict[str, Any] = {"tokens": None, "source": None}
    return {
        model: {"tokens": known[model], "source": source} if model in known else unknown
        for model in pool.config.models
    }


def _worker(worker: Worker, now_s: float, pool: Pool, fleet: Fleet | None) -> dict[str, Any]:
    reported = pool.windows.reported(worker.worker_id)
    out: dict[str, Any] = {
        "url": worker.url,
        "healthy": worker.healthy,
        "routable": worker.healthy and worker.breaker.allows(now_s),
        "breaker": {
            "state": str(worker.breaker.state(now_s)),
            "consecutive_failures": worker.breaker.failures,
        },
        "in_flight": worker.in_flight,
        "prefill_tokens": worker.prefill_tokens,
        "decode_tokens": worker.decode_tokens,
        "decode_context_tokens": worker.decode_context,
        "prefill_pairs": worker.prefill_pairs,
        "max_model_len": dict(reported) if reported is not None else None,  # its cards' windows
        "scrape": None,
        "kv_events": None,
    }
    scraper = fleet.scraper if fleet is not None else None
    scrape = scraper.state(worker.worker_id) if scraper is not None else None
    if scrape is not None:
        age_s = scrape.last.age_s(now_s) if scrape.last is not None else None
        out["scrape"] = {
            "age_s": _round(age_s),
            "fresh": age_s is not None and age_s <= pool.metrics_max_age_s,
            "failures": scrape.failures,
            "consecutive_failures": scrape.consecutive_failures,
            "last_error": scrape.last_error,
        }
    subscriber = fleet.kv_events if fleet is not None else None
    if subscriber is not None and worker.worker_id in subscriber.workers():
        streams = {}
        for endpoint, stats in subscriber.stream_stats(worker.worker_id).items():
            fields = dataclasses.asdict(stats)
            last = fields.pop("last_batch_monotonic_s")
            fields["last_batch_age_s"] = _round(now_s - last if last is not None else None)
            streams[endpoint] = fields
        out["kv_events"] = streams
    return out


def _policy(state: GatewayState, watcher: PolicyWatcher | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": state.routing.policy_name, "policy_file": None, "stats": None}
    if watcher is not None:
        out["policy_file"] = _policy_status(watcher.status())
    policy = state.routing.policy
    if isinstance(policy, SupportsStats):
        stats = policy.stats()
        out["stats"] = {
            "decisions_by_reason": dict(stats.decisions_by_reason),
            "counters": dict(stats.counters),
            "index": {pool: _plain(dataclasses.asdict(ix)) for pool, ix in stats.index.items()},
        }
    return out


def _policy_status(status: PolicyStatus) -> dict[str, Any]:
    return dataclasses.asdict(status)


def _plain(value: Mapping[str, Any]) -> dict[str, Any]:
    return {k: dict(v) if isinstance(v, Mapping) else v for k, v in value.items()}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _json(obj: object, status: int) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")
