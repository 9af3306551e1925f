from __future__ import annotations

import re
from pathlib import Path

import pytest

from policies.base import Isolation
from policies.config import PolicyConfigError, build_policy, parse_policy_yaml
from policies.cost_policy import CostPolicy

DOC = Path(__file__).resolve().parents[2] / "docs" / "policy.md"


def test_valid_file_builds_policy() -> None:
    cfg = parse_policy_yaml("policy: least_load\nseed: 3\n")
    assert build_policy(cfg).name == "least_load"


def test_empty_file_is_the_cost_policy() -> None:
    assert build_policy(parse_policy_yaml("")).name == "cost"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("polcy: x\n", "polcy"),
        ("seed: abc\n", "seed"),
        ("policy: [\n", "YAML"),
        ("- a\n- b\n", "mapping"),
        ("pools:\n  chat:\n    cost_model:\n      step_s: -1\n", r"pools\.chat\.cost_model\.step_s"),
        (
            "pools:\n  chat:\n    cost_model:\n      profile: gpt9\n",
            r"pools\.chat\.cost_model\.profile.*llama3",
        ),
        ("tenants:\n  acme:\n    isolation: open\n", r"tenants\.acme\.isolation"),
        ("default_pool:\n  index:\n    granularity: 2\n", r"default_pool\.index\.granularity"),
        ("public_prefixes:\n  allow_list: [zz]\n", r"public_prefixes\.allow_list"),
        ("normalizer:\n  mode: psychic\n", r"normalizer\.mode"),
        ("cost:\n  epsilon: -0.1\n", r"cost\.epsilon"),
        # YAML's infinities and NaN: no setting means either (an infinite weight made every score
        # NaN and every routed request a 500).
        ("cost:\n  work_weight: .inf\n", r"cost\.work_weight: Input should be a finite number"),
        ("cost:\n  decode_price_s: .nan\n", r"cost\.decode_price_s: Input should be a finite number"),
        ("pools:\n  chat:\n    cost_model:\n      step_s: .inf\n", r"pools\.chat\.cost_model\.step_s: Input"),
        ("normalizer:\n  drift_sessions_max: .inf\n", r"normalizer\.drift_sessions_max"),
        (
            "pools:\n  chat:\n    worker_capacity_tokens: {http://w:8000: -5}\n",
            r"pools\.chat\.worker_capacity_tokens\.http://w:8000: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_file_names_the_problem(text: str, needle: str) -> None:
    with pytest.raises(PolicyConfigError, match=needle):
        parse_policy_yaml(text)


def test_unknown_policy_name_lists_known() -> None:
    with pytest.raises(PolicyConfigError, match="round_robin"):
        build_policy(parse_policy_yaml("policy: nope\n"))


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("policy: random\noptions:\n  bogus: 1\n", "options"),
        ("cost:\n  epsilon: 0.5\n  bogus: 1\n", "cost.bogus"),
        ("sglang_cache_aware: {cache_threshold: 0.3, typo: 2}\n", "sglang_cache_aware.typo"),
        ("preble_e2: {window_s: 0}\n", "preble_e2.window_s"),
    ],
)
def test_policy_options_are_typed_per_policy(text: str, field: str) -> None:
    with pytest.raises(PolicyConfigError, match=field.replace(".", r"\.")):
        parse_policy_yaml(text)


def test_documented_example_parses_and_builds_every_policy() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/policy.md lost its example"
    cfg = parse_policy_yaml(blocks[0])
    assert cfg.tenants["docs-bot"].isolation is Isolation.PUBLIC
    assert cfg.normalizer.chars_per_token == 4
    policy = build_policy(cfg)
    assert isinstance(policy, CostPolicy) and policy.epsilon == 0.5 and policy.work_weight == 2.0
    shared = cfg.shared_settings()
    assert shared.pools["llama"].cost.transfer_enabled
    assert shared.pools["llama"].cost.step_s == 0.017  # from the profile, not overridden
    assert shared.default_pool.index.max_workers == 1024
    for name in ("round_robin", "random", "least_load", "consistent_hash", "sglang_cache_aware", "preble_e2"):
        assert build_policy(cfg.model_copy(update={"policy": name})).name == name


def test_anchors_and_aliases_share_values() -> None:
    text = "policy: cost\ndefault_pool: &p {capacity_fraction: 0.5}\npools:\n  a: *p\n  b:\n    <<: *p\n"
    cfg = parse_policy_yaml(text)
    assert cfg.pools["a"].capacity_fraction == cfg.pools["b"].capacity_fraction == 0.5


def test_a_document_nested_too_deeply_for_the_parser_is_refused() -> None:
    with pytest.raises(PolicyConfigError, match="nested too deeply"):
        parse_policy_yaml("policy: cost\nx: " + "[" * 5000 + "]" * 5000 + "\n")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # Ten levels of ten aliases each: 21 lines that expand to 10^10 values.
        (
            "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 10)).join(
                ["a: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n", "policy: cost\n"]
            ),
            "expands to more than 1,000,000 values",
        ),
        ("policy: cost\nx: &x [1, *x]\n", "refers to the value that contains it"),
    ],
)
def test_aliases_that_expand_past_the_bound_are_refused(text: str, needle: str) -> None:
    with pytest.raises(PolicyConfigError, match=re.escape(needle)):
        parse_policy_yaml(text)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cost: {epsilon: 0.5, epsilon: 0.7}\n", "duplicate key 'cost.epsilon' on line 1 (first on line 1)"),
        (
            "cost:\n  epsilon: 0.5\n  epsilon: 0.7\n",
            "duplicate key 'cost.epsilon' on line 3 (first on line 2)",
        ),
        ("policy: cost\nseed: 1\npolicy: least_load\n", "duplicate key 'policy' on line 3 (first on line 1)"),
        ("pools:\n  a: {}\n  a: {capacity_fraction: 0.5}\n", "duplicate key 'pools.a' on line 3"),
        (
            "public_prefixes:\n  allow_list: [{k: 1, k: 2}]\n",
            "duplicate key 'public_prefixes.allow_list.0.k' on line 2",
        ),
    ],
)
def test_a_key_said_twice_is_refused_with_its_path_and_lines(text: str, needle: str) -> None:
    with pytest.raises(PolicyConfigError, match=re.escape(needle)):
        parse_policy_yaml(text)


def test_a_merged_key_may_be_overridden() -> None:
    assert parse_policy_yaml("cost:\n  <<: {epsilon: 0.5}\n  epsilon: 0.7\n").cost.epsilon == 0.7
    text = "default_pool: &p {capacity_fraction: 0.5}\npools:\n  a:\n    <<: *p\n    capacity_fraction: 0.6\n"
    assert parse_policy_yaml(text).pools["a"].capacity_fraction == 0.6
