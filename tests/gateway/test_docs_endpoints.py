"""docs/gateway.md agrees with the app: the `endpoint` values the gateway can emit, the route
table's paths, the metric families of the /metrics page, the reasons the client limits count
(in the docs and the metric's help) and the front door's 400s."""

from __future__ import annotations

import re
from pathlib import Path

from starlette.routing import Route

from gateway.app import build_app, build_metrics_app
from gateway.config import parse_config
from gateway.metrics.catalogue import MetricCatalogue
from gateway.responses_routes import STORED_RESPONSE_ENDPOINTS
from gateway.routes import ROUTES
from gateway.state import build_state
from policies.config import PolicyConfig, build_policy
from prompt_normalizer.normalizer import NormalizerConfig
from tests.support.gateway_config import SECRET, tenant

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def section(title: str) -> str:
    """The text of `## title`, up to the next heading of that level."""
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_documented_endpoint_labels_are_the_route_tables() -> None:
    row = next(line for line in DOC.read_text().splitlines() if line.startswith("| `kvgate_requests_total`"))
    listed = re.search(r"`endpoint` \(([^;]*?):", row)
    assert listed is not None, row
    documented = re.findall(r"`([a-z_.]+)`", listed.group(1))
    emitted = list(dict.fromkeys(route.endpoint for route in ROUTES.values()))
    assert documented == [*emitted, *STORED_RESPONSE_ENDPOINTS]


def served_paths() -> set[str]:
    """Every path the client port and the metrics listener answer other than with 404 or 405,
    path parameters written `{id}` as in the docs (admin routes on: they exist only with a key)."""
    config = parse_config(
        {
            "pools": [{"name": "p", "models": ["m"], "workers": ["http://127.0.0.1:9"]}],
            "tenants": [tenant("t", "k")],
            "admin": {"api_key_hash": "hmac-sha256:" + "1" * 64},
        }
    )
    state = build_state(config, SECRET, build_policy(PolicyConfig()), NormalizerConfig())
    routes = [*build_app(state, None).fallback.routes, *build_metrics_app(state).routes]
    # The routes with GET, PUT, DELETE and PATCH only are the proxied paths' 405s.
    answered = {r.path for r in routes if isinstance(r, Route) and r.methods and {"GET", "POST"} & r.methods}
    answered -= {r.path for r in routes if isinstance(r, Route) and r.methods and "PUT" in r.methods}
    return {re.sub(r"\{[^}]*\}", "{id}", path) for path in answered | set(ROUTES)}


def test_the_route_table_lists_every_path_the_gateway_serves() -> None:
    rows = [line for line in section("Routes").splitlines() if line.startswith("| `")]
    documented = {path for row in rows for path in re.findall(r"(/[\w/{}.-]*)", row.split("|")[1])}
    assert served_paths() == documented


def test_the_metrics_table_names_every_family_of_the_page() -> None:
    exported = set()
    for family in MetricCatalogue().registry.collect():
        if not family.name.startswith(("process_", "python_")):
            exported.add(family.name + ("_total" if family.type == "counter" else ""))
    table = [line for line in section("Observability").splitlines() if line.startswith("| `")]
    documented = {name for row in table for name in re.findall(r"`(kvgate_\w+)`", row.split("|")[1])}
    assert exported == documented


def client_refusal_reasons() -> set[str]:
    """Every `reason` the client limits count (`gateway/http_limits.py`): the reasons of its
    refusals, of the guard's own counts, and of the connection limits; and of the framing
    checks (`gateway/http_framing.py`)."""
    gateway = Path(__file__).resolve().parents[2] / "gateway"
    calls = r'(?:_HeadRefused\(|_refuse\(\d+, |refused\(|_abort\(|return |refused = )"([a-z_]+)"'
    framing = r'FramingFault\(\s*\d+,\s*"([a-z_]+)"'
    return set(re.findall(calls, (gateway / "http_limits.py").read_text())) | set(
        re.findall(framing, (gateway / "http_framing.py").read_text())
    )


def test_every_client_refusal_reason_is_in_the_metrics_help_and_the_docs() -> None:
    reasons = client_refusal_reasons()
    assert {"upgrade_with_body", "invalid_http", "address_limit", "send_timeout"} <= reasons
    family = next(f for f in MetricCatalogue().registry.collect() if f.name == "kvgate_client_refusals")
    row = next(
        line for line in DOC.read_text().splitlines() if line.startswith("| `kvgate_client_refusals_total`")
    )
    listed = set(re.findall(r"`([a-z_]+)`", row.split("|")[3].split("(")[0])) - {"reason"}
    assert {r for r in reasons if r not in family.documentation} == set()
    assert listed == reasons


def test_the_error_table_has_every_400_the_front_door_answers() -> None:
    rows = [line for line in section("Routes").splitlines() if line.startswith("| 400 |")]
    codes = {code for row in rows for code in re.findall(r"`([a-z_]+)`", row.split("|")[3])}
    assert {"invalid_http", "upgrade_with_body", "invalid_api_key"} <= codes
    assert any("API key sent twice" in row for row in rows)
    family = next(f for f in MetricCatalogue().registry.collect() if f.name == "kvgate_requests")
    assert "sent twice (400 invalid_api_key)" in family.documentation
