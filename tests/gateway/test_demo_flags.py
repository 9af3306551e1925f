"""The demo's flags are checked before anything starts (`serve.apply_mode_flags`): `--pd-protocol`
without `--pd P:D` asked for a protocol that mixed workers never speak, and the demo started
without a word about it."""

from __future__ import annotations

import argparse

import pytest

from gateway import serve
from gateway.config.base import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_pd_protocol_without_pd_is_refused() -> None:
    with pytest.raises(ConfigError, match="--pd-protocol: only with --pd P:D"):
        serve.apply_mode_flags(_args("--demo", "--pd-protocol", "sglang"))


@pytest.mark.parametrize(
    ("argv", "workers", "protocol", "key"),
    [
        (["--demo"], 2, "vllm", serve.DEMO_KEY),
        (["--demo", "--pd", "1:1", "--pd-protocol", "sglang"], 2, "sglang", serve.DEMO_KEY),
        (["--demo", "--workers", "3", "--demo-key", "sk-mine"], 3, "vllm", "sk-mine"),
    ],
)
def test_the_demo_gets_its_flags_or_their_defaults(
    argv: list[str], workers: int, protocol: str, key: str
) -> None:
    args = _args(*argv)
    serve.apply_mode_flags(args)
    assert (args.workers, args.pd_protocol, args.demo_key) == (workers, protocol, key)
