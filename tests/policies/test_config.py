import pytest

from policies.config import PolicyConfigError, build_policy, parse_policy_yaml


def test_valid_file_builds_policy() -> None:
    cfg = parse_policy_yaml("policy: least_load\nseed: 3\n")
    assert build_policy(cfg).name == "least_load"


@pytest.mark.parametrize(
    ("text", "needle"),
    [("polcy: x\n", "polcy"), ("seed: abc\n", "seed"), ("policy: [\n", "YAML")],
)
def test_bad_file_names_the_problem(text: str, needle: str) -> None:
    with pytest.raises(PolicyConfigError, match=needle):
        parse_policy_yaml(text)


def test_unknown_policy_name_lists_known() -> None:
    with pytest.raises(PolicyConfigError, match="round_robin"):
        build_policy(parse_policy_yaml("policy: nope\n"))
