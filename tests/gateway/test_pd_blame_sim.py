"""Who `gateway.pd_suspects` blames, over simulated requests (`tests.gateway.pd_blame_sim`): no
healthy worker ever, beside a partner failing at random, an overloaded one, or broken ones; and
a stuck prefill worker with a broken decode worker in a 2:2 pool, both, within a few dozen
requests. The seeds are fixed: each run is the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.pd_blame_sim import Behaviour, pool_of, simulate

BROKEN = Behaviour("broken")
POLICIES = ("ordered", "random", "sticky")


def _pools() -> Iterator[tuple[str, dict[str, Behaviour]]]:
    for f in (0.1, 0.3):
        flapping = Behaviour("flapping", f)
        yield f"2:1 d1 flapping {f}", pool_of("2:1", d1=flapping)
        yield f"1:2 p1 flapping {f}", pool_of("1:2", p1=flapping)
        yield f"3:1 d1 flapping {f}", pool_of("3:1", d1=flapping)
        yield f"1:3 p1 flapping {f}", pool_of("1:3", p1=flapping)
        yield f"2:2 d1 flapping {f}", pool_of("2:2", d1=flapping)
        yield f"2:2 d1 flapping {f}, d2 broken", pool_of("2:2", d1=flapping, d2=BROKEN)
        yield f"2:2 d1 flapping {f}, p2 stuck", pool_of("2:2", d1=flapping, p2=BROKEN)
        yield f"2:2 p1 flapping {f}, d2 broken", pool_of("2:2", p1=flapping, d2=BROKEN)
        yield f"3:1 d1 flapping {f}, p2 stuck", pool_of("3:1", d1=flapping, p2=BROKEN)
        yield f"1:3 p1 flapping {f}, d2 broken", pool_of("1:3", p1=flapping, d2=BROKEN)
        yield f"2:2 d1 flapping {f}, p2 stuck, d2 broken", pool_of("2:2", d1=flapping, p2=BROKEN, d2=BROKEN)
        yield f"2:2 d1 overloaded {f}, p2 stuck", pool_of("2:2", d1=Behaviour("overloaded", f), p2=BROKEN)


@pytest.mark.parametrize(("label", "behaviours"), list(_pools()), ids=[label for label, _ in _pools()])
def test_no_healthy_worker_is_blamed(label: str, behaviours: dict[str, Behaviour]) -> None:
    healthy = {name for name, b in behaviours.items() if b.kind == "healthy"}
    for policy in POLICIES:
        for seed in range(2):
            result = simulate(behaviours, 2000, seed, policy=policy)
            assert not healthy & set(result.blamed), (label, policy, seed, result.blamed)


@pytest.mark.parametrize("policy", ["random", "sticky"])
def test_a_stuck_prefill_worker_and_a_broken_decode_worker_are_both_blamed(policy: str) -> None:
    # With `ordered` no request meets either: p1 and d1 serve every first round.
    for seed in range(3):
        result = simulate(pool_of("2:2", p2=BROKEN, d2=BROKEN), 2000, seed, policy=policy)
        assert result.first_open.keys() == {"p2", "d2"}, (seed, result.blamed)
        assert max(result.first_open.values()) <= 200, (seed, result.first_open)
