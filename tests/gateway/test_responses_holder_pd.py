"""A follow-up of a response that an SGLang decode server holds cannot be continued there (that
server runs only requests prefilled elsewhere): a gateway process that knows the holder refuses it
with 400 (`responses_affinity.pin`), and so does one that found the holder by asking the workers
(another process or replica, or one restarted). Before, the search pinned the follow-up to the
decode server, alone, where it could not run."""

from __future__ import annotations

import pytest

from tests.gateway.test_responses_pd_holder import KEY, gateway, pd_workers


@pytest.mark.parametrize("stream", [False, True])
async def test_a_found_sglang_decode_holder_is_refused_as_a_known_one(stream: bool) -> None:
    async with pd_workers() as (prefill, decode):
        async with gateway(prefill, decode) as first:
            created = await first.post("/v1/responses", json={"model": "m", "input": "hello"}, headers=KEY)
            assert created.status_code == 200
            rid = created.json()["id"]
            follow_up = {"model": "m", "input": "and?", "previous_response_id": rid, "stream": stream}
            known = await first.post("/v1/responses", json=follow_up, headers=KEY)
        sent = [len(prefill.received), len(decode.received)]
        async with gateway(prefill, decode) as another:
            found = await another.post("/v1/responses", json=follow_up, headers=KEY)
            assert found.status_code == 400, found.text
            assert found.json() == known.json()
            assert found.json()["error"]["param"] == "previous_response_id"
            # The decode worker was asked for it (a GET), and sent nothing else; the prefill
            # worker was not asked at all.
            assert [r.path for r in decode.received[sent[1] :]] == [f"/v1/responses/{rid}"]
            assert len(prefill.received) == sent[0]
            # Remembered: the next one is refused without asking.
            again = await another.post("/v1/responses", json=follow_up, headers=KEY)
            assert again.status_code == 400 and len(decode.received) == sent[1] + 1
