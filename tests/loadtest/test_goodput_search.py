from __future__ import annotations

import math

import pytest
import yaml

from loadtest.goodput.config import GoodputConfigError, default_config_text, parse_goodput_yaml
from loadtest.goodput.search import Capacity, SearchSettings, find_capacity


class Threshold:
    """passes(r) = r <= limit, recording every call."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.calls: list[float] = []

    def __call__(self, rate: float) -> bool:
        self.calls.append(rate)
        return rate <= self.limit


@pytest.mark.parametrize("limit", [0.3, 0.99, 1.0, 3.3, 7.9])
def test_capacity_brackets_the_threshold_within_the_tolerance(limit: float) -> None:
    f = Threshold(limit)
    cap = find_capacity(f, SearchSettings(start=1.0, lo_bound=0.05, hi_bound=64.0, tolerance=0.05))
    assert cap.load is not None and cap.failing_load is not None
    assert cap.load <= limit < cap.failing_load
    assert cap.failing_load / cap.load <= 1.05
    assert len(f.calls) == len(set(f.calls)), "a rate was measured twice"
    assert f.calls[0] == 1.0, "the search starts at the reference rate"


def test_coarse_steps_then_bisection_use_few_points() -> None:
    f = Threshold(3.3)
    find_capacity(f, SearchSettings(1.0, lo_bound=0.05, hi_bound=64.0, coarse_factor=2.0, tolerance=0.05))
    # 1, 2, 4 bracket [2, 4]; log2(ln 2 / ln 1.05) ≈ 3.8 halvings of the log gap follow.
    assert f.calls[:3] == [1.0, 2.0, 4.0]
    assert len(f.calls) <= 3 + math.ceil(math.log2(math.log(2) / math.log(1.05)))


def test_bounds_end_the_search() -> None:
    always = Threshold(math.inf)
    assert find_capacity(always, SearchSettings(1.0, 0.25, 8.0)) == Capacity(8.0, None)
    assert always.calls == [1.0, 2.0, 4.0, 8.0]
    never = Threshold(0.0)
    assert find_capacity(never, SearchSettings(1.0, 0.25, 8.0)) == Capacity(None, 0.25)
    assert never.calls == [1.0, 0.5, 0.25]


def test_settings_refuse_a_start_outside_the_bounds() -> None:
    with pytest.raises(ValueError, match="lo_bound <= start"):
        SearchSettings(start=10.0, lo_bound=0.1, hi_bound=8.0)


def test_shipped_config_names_the_three_traces_and_every_baseline() -> None:
    cfg = parse_goodput_yaml(default_config_text())
    assert set(cfg.traces) == {"mooncake-conversation", "mooncake-synthetic", "kvct-agent"}
    assert set(cfg.baselines) == set(cfg.policies) - {"cost"} and cfg.subject == "cost"
    for spec in cfg.traces.values():
        assert spec.min_rate_scale <= spec.reference_rate_scale <= spec.max_rate_scale


def _config(**changes: object) -> str:
    doc = yaml.safe_load(default_config_text())
    doc.update(changes)
    return yaml.safe_dump(doc)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(GoodputConfigError, match="attainment_share"):
        parse_goodput_yaml(_config(attainment_share=1.5))
    with pytest.raises(GoodputConfigError, match="surprise"):
        parse_goodput_yaml(_config(surprise=1))
    with pytest.raises(GoodputConfigError, match="baselines"):
        parse_goodput_yaml(_config(baselines=["random"]))
    bad_trace = {"t": {"ttft_slo_s": 1, "tpot_slo_s": 0.1, "reference_rate_scale": 100, "max_rate_scale": 8}}
    with pytest.raises(GoodputConfigError, match="reference_rate_scale"):
        parse_goodput_yaml(_config(traces=bad_trace))


def test_the_goal_verdict_uses_both_brackets() -> None:
    from loadtest.goodput.report import goal_text

    other = Capacity(6.263, 6.541)
    assert "undecided" in goal_text(Capacity(8.123, 8.482), other)  # 1.24–1.35 straddles 1.3
    assert "1.297×" in goal_text(Capacity(8.123, 8.482), other)
    assert goal_text(Capacity(9.0, 9.4), other).endswith("met)")  # 9.0 / 6.541 = 1.38
    assert goal_text(Capacity(7.0, 7.3), other).endswith("missed)")  # 7.3 / 6.263 = 1.17
    assert goal_text(Capacity(2.0, 2.1), Capacity(None, 0.1)).endswith("met)")
    assert goal_text(Capacity(None, 0.1), other).endswith("missed)")


def test_rows_may_be_pd_splits_with_labels() -> None:
    from loadtest.goodput.config import load_goodput_config

    cfg = load_goodput_config("pd")  # the shipped P/D config, by name
    assert cfg.labels() == ("cost", "cost 4:4", "cost 3:5", "cost 2:6", "round_robin-prefill 4:4")
    assert [e.split() for e in cfg.entries()] == [None, (4, 4), (3, 5), (2, 6), (4, 4)]
    assert cfg.subject == "cost 4:4" and cfg.baselines == ("cost",)
    default = parse_goodput_yaml(default_config_text())
    for name in ("mooncake-conversation", "mooncake-synthetic"):
        assert cfg.traces[name] == default.traces[name], "the same SLOs and bounds as default.yaml"
    # A bare name keeps its old point key, so earlier points files resume.
    assert cfg.entries()[0].point_key == "cost" and cfg.entries()[1].point_key != "cost 4:4"


def test_pd_rows_are_validated() -> None:
    with pytest.raises(GoodputConfigError, match="workers"):
        parse_goodput_yaml(_config(policies=[{"policy": "cost", "pd": "4:5"}], baselines=[]))
    with pytest.raises(GoodputConfigError, match="P:D"):
        parse_goodput_yaml(_config(policies=[{"policy": "cost", "pd": "4-4"}], baselines=[]))
    with pytest.raises(GoodputConfigError, match="label"):
        parse_goodput_yaml(_config(policies=["cost", {"policy": "cost", "name": "cost"}], baselines=[]))
    ok = parse_goodput_yaml(
        _config(policies=["cost", {"policy": "cost", "pd": "2:6"}], baselines=["cost 2:6"], subject="cost")
    )
    assert ok.baselines == ("cost 2:6",)


def test_the_tight_tpot_config_differs_from_pd_only_in_rows_and_slos() -> None:
    from loadtest.goodput.config import load_goodput_config

    pd, tight = load_goodput_config("pd"), load_goodput_config("pd-tight-tpot")
    assert tight.labels() == ("cost", "cost 4:4", "cost 3:5")
    for name, spec in tight.traces.items():
        assert spec.tpot_slo_s == 0.02 and spec.ttft_slo_s == 2 * pd.traces[name].ttft_slo_s
        same = {"ttft_slo_s", "tpot_slo_s"}
        assert spec.model_dump(exclude=same) == pd.traces[name].model_dump(exclude=same)


def test_without_a_goal_the_ratio_has_no_verdict() -> None:
    from loadtest.goodput.config import load_goodput_config
    from loadtest.goodput.report import goal_text

    assert load_goodput_config("pd").goal is None and parse_goodput_yaml(default_config_text()).goal == 1.3
    text = goal_text(Capacity(2.0, 2.1), Capacity(1.0, 1.05), None)
    assert text == "2.000× (1.90–2.10× within the search brackets)"


def test_the_holder_config_is_default_yaml_with_a_holder_prefill_row() -> None:
    from loadtest.goodput.config import load_goodput_config

    holder, default = load_goodput_config("holder"), parse_goodput_yaml(default_config_text())
    assert holder.labels() == ("preble_e2", "cost", "cost holder_prefill")
    assert [e.split() for e in holder.entries()] == [None, None, None]
    assert holder.entries()[2].pd == "holder_prefill" and holder.subject == "cost holder_prefill"
    assert holder.traces == default.traces and holder.workers == default.workers


@pytest.mark.parametrize(
    ("start", "factor", "limit"), [(2, 1.25, 5), (3, 1.2, 1), (40, 1.5, 43), (4, 2.0, 1), (1, 1.1, 7)]
)
def test_a_users_search_steps_by_whole_users_however_small_the_factor(
    start: int, factor: float, limit: int
) -> None:
    from loadtest.goodput.search import round_users

    f = Threshold(limit)
    settings = SearchSettings(start, lo_bound=1, hi_bound=64, coarse_factor=factor, tolerance=0.01)
    cap = find_capacity(f, settings, round_users, 1.0)
    assert (cap.load, cap.failing_load) == (limit, limit + 1)
    assert all(u == int(u) for u in f.calls) and len(f.calls) == len(set(f.calls))


def test_half_users_round_up() -> None:
    from loadtest.goodput.search import round_users

    assert [round_users(x) for x in (0.2, 1.5, 2.5, 3.49)] == [1.0, 2.0, 3.0, 3.0]
