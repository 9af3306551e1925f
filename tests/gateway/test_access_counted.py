"""Every request the access log records on an API route is counted in `kvgate_requests_total`,
under the same endpoint, status, tenant and model (a model only once it is a served one)."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import hash_api_key
from tests.gateway.access_lines import AccessLines, capture_access
from tests.gateway.routes_rig import SECRET, Rig, routes_rig

RESPONSES_BODY = {"model": "m", "input": "hello"}


def _counted(r: Rig) -> Counter[tuple[str, str, str, str]]:
    """`kvgate_requests_total` by (endpoint, status, tenant, model)."""
    out: Counter[tuple[str, str, str, str]] = Counter()
    for family in text_string_to_metric_families(r.state.routing.metrics.render().decode()):
        for s in family.samples:
            if s.name == "kvgate_requests_total":
                labels = s.labels
                key = (labels["endpoint"], labels["status"], labels["tenant"], labels["model"])
                out[key] += int(s.value)
    return out


def _logged(lines: AccessLines) -> Counter[tuple[str, str, str, str]]:
    """The access lines by the same labels (null as the empty label)."""
    lines.flush()
    return Counter(
        (line["endpoint"], str(line["status"]), line["tenant"] or "", line["model"] or "")
        for line in lines.records
    )


async def test_stored_response_requests_refused_for_their_key_are_counted() -> None:
    async with routes_rig() as r:
        lines = capture_access(r.state)
        created = await r.client.post(
            "/v1/responses", json=RESPONSES_BODY, headers={"authorization": "Bearer sk-t"}
        )
        rid = created.json()["id"]
        assert (await r.client.get(f"/v1/responses/{rid}")).status_code == 401  # no key
        wrong = {"authorization": "Bearer sk-wrong"}
        assert (await r.client.post(f"/v1/responses/{rid}/cancel", headers=wrong)).status_code == 401
        ok = {"authorization": "Bearer sk-t"}
        assert (await r.client.get(f"/v1/responses/{rid}", headers=ok)).status_code == 200
        logged = _logged(lines)
        assert logged[("responses.retrieve", "401", "", "")] == 1
        assert logged[("responses.cancel", "401", "", "")] == 1
        assert _counted(r) == logged


async def test_a_refusal_after_the_model_was_resolved_is_counted_under_it() -> None:
    """The tpm quota's 429 (and any refusal after `admit` found the served model) is counted
    with that model, as its access line names it; an unknown model's 404 is not (its name is
    the client's)."""
    tenants = [
        {"name": "t", "api_key_hashes": [hash_api_key(SECRET, "sk-t")], "quotas": {"tpm": 5}},
    ]
    async with routes_rig(tenants=tenants) as r:
        lines = capture_access(r.state)
        key = {"authorization": "Bearer sk-t"}
        big = {"model": "m", "input": "hello there " * 40}
        assert (await r.client.post("/v1/responses", json=big, headers=key)).status_code == 429
        bad = {**RESPONSES_BODY, "request_id": "no spaces"}
        assert (await r.client.post("/v1/responses", json=bad, headers=key)).status_code == 400
        unknown = {**RESPONSES_BODY, "model": "nope"}
        assert (await r.client.post("/v1/responses", json=unknown, headers=key)).status_code == 404
        logged = _logged(lines)
        assert logged[("responses", "429", "t", "m")] == 1
        assert logged[("responses", "400", "t", "m")] == 1
        assert logged[("responses", "404", "t", "")] == 1
        assert _counted(r) == logged
        assert not any(w.received for w in r.workers)
