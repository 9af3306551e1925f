from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics


def _samples(m: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_hot_counters_and_histograms_render_as_prometheus_families() -> None:
    m = GatewayMetrics()
    for duration_s in (0.005, 0.0051, 7.0, 500.0):  # on a bound, just past it, mid, past the last
        m.observe(
            model="m",
            tenant="t",
            endpoint="chat",
            status=200,
            duration_s=duration_s,
            ttft_s=None,
            prompt_tokens=10,
            cached_tokens=4,
            completion_tokens=None,
        )
    m.observe(
        model="m2",
        tenant="t",
        endpoint="completions",
        status=502,
        duration_s=0.2,
        ttft_s=0.1,
        prompt_tokens=None,
        cached_tokens=None,
        completion_tokens=None,
    )
    m.decision("cost", "hit")
    m.decision("cost", "hit")
    m.rejected("chat", 401)
    s = _samples(m)
    ok = (("endpoint", "chat"), ("model", "m"), ("status", "200"), ("tenant", "t"))
    assert s[("kvgate_requests_total", ok)] == 4
    assert (
        s[("kvgate_requests_total", (("endpoint", "chat"), ("model", ""), ("status", "401"), ("tenant", "")))]
        == 1
    )
    bucket = "kvgate_request_duration_seconds_bucket"
    assert s[(bucket, (("le", "0.005"), ("model", "m")))] == 1  # le: a value on the bound counts
    assert s[(bucket, (("le", "0.01"), ("model", "m")))] == 2
    assert s[(bucket, (("le", "10.0"), ("model", "m")))] == 3
    assert s[(bucket, (("le", "120.0"), ("model", "m")))] == 3
    # As far as `timeouts.total_s`' default: a request of 500 s is in a bucket of its own.
    assert s[(bucket, (("le", "300.0"), ("model", "m")))] == 3
    assert s[(bucket, (("le", "600.0"), ("model", "m")))] == 4
    assert s[(bucket, (("le", "3600.0"), ("model", "m")))] == 4
    assert (("le", "300.0"), ("model", "m")) not in {
        k[1] for k in s if k[0].startswith("kvgate_time_to_first")
    }
    assert s[(bucket, (("le", "+Inf"), ("model", "m")))] == 4
    assert s[("kvgate_request_duration_seconds_count", (("model", "m"),))] == 4
    assert s[("kvgate_request_duration_seconds_sum", (("model", "m"),))] == 0.005 + 0.0051 + 7.0 + 500.0
    assert s[("kvgate_time_to_first_token_seconds_count", (("model", "m2"),))] == 1
    assert s[("kvgate_time_to_first_token_seconds_count", (("model", "m"),))] == 0  # none streamed
    assert s[("kvgate_prompt_tokens_total", (("model", "m"), ("tenant", "t")))] == 40
    assert s[("kvgate_cached_prompt_tokens_total", (("model", "m"), ("tenant", "t")))] == 16
    assert s[("kvgate_routing_decisions_total", (("policy", "cost"), ("reason", "hit")))] == 2
