"""Stored-response ids: a minted id verifies for its tenant under its deployment's secret and for
nothing else, a client's `request_id` is kept in front of a part that makes every id new, no two
ids meet, and anything that is not such an id is simply not owned."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from gateway.responses_ids import (
    MAX_REQUEST_ID_CHARS,
    MAX_RESPONSE_ID_CHARS,
    TAG_CHARS,
    UNIQUE_CHARS,
    ResponseIds,
    valid_response_id,
)

IDS = ResponseIds(b"a deployment's key-hash secret, 32+ bytes")
ID_ALPHABET = string.ascii_letters + string.digits + "_.:-"
stems = st.text(ID_ALPHABET, min_size=1, max_size=MAX_REQUEST_ID_CHARS)
tenants = st.text(ID_ALPHABET, min_size=1, max_size=40)


def test_a_minted_id_is_vllms_form_with_a_tag_and_owned_by_its_tenant_only() -> None:
    rid = IDS.mint("alice")
    stem, tag = rid[: -TAG_CHARS - 1], rid[-TAG_CHARS:]
    assert rid[-TAG_CHARS - 1] == "_" and stem.startswith("resp_") and len(stem) == 37
    assert all(c in string.ascii_lowercase + "234567" for c in tag)
    assert IDS.owned_by(rid, "alice")
    assert not IDS.owned_by(rid, "bob") and not IDS.owned_by(rid, "alice2")
    assert IDS.mint("alice") != rid  # a fresh random stem each time
    # Another deployment (another secret) owns none of this one's ids.
    assert not ResponseIds(b"another deployment's secret, 32 bytes").owned_by(rid, "alice")


def test_a_clients_request_id_starts_a_new_id_each_time_tagged_per_tenant() -> None:
    mine = IDS.mint("alice", "conv-42")
    unique = mine[len("conv-42_") : -TAG_CHARS - 1]
    assert mine.startswith("conv-42_") and mine[-TAG_CHARS - 1] == "_"
    assert len(unique) == UNIQUE_CHARS and all(c in string.hexdigits for c in unique)
    # Sent again, the same value names another response: never two stored under one id.
    again = IDS.mint("alice", "conv-42")
    assert again != mine and again.startswith("conv-42_") and IDS.owned_by(again, "alice")
    theirs = IDS.mint("bob", "conv-42")
    assert theirs != mine and IDS.owned_by(theirs, "bob") and not IDS.owned_by(mine, "bob")
    # Another tenant's whole id as a stem names a new id of the asker's, never the original.
    taken = IDS.mint("bob", mine)
    assert taken.startswith(mine + "_") and IDS.owned_by(taken, "bob") and not IDS.owned_by(taken, "alice")
    longest = IDS.mint("alice", "x" * MAX_REQUEST_ID_CHARS, model="m")
    assert len(longest) == MAX_RESPONSE_ID_CHARS and valid_response_id(longest)


def test_an_id_names_the_scope_of_its_model_opaquely_and_under_its_tag() -> None:
    """The scope (`responses_search.pools_to_search`) is the model's keyed hash, covered by the tag;
    an id minted without one, whatever the client's `request_id` looks like, has none."""
    rid = IDS.mint("alice", model="llama-3-8b")
    assert "llama" not in rid and IDS.owned_by(rid, "alice")
    assert IDS.scope_of(rid) == IDS.scope("llama-3-8b") != IDS.scope("llama-3-70b")
    assert rid.startswith("resp_") and rid[: -TAG_CHARS - 1].endswith("_" + IDS.scope("llama-3-8b"))
    other = ResponseIds(b"another deployment's secret, 32 bytes")
    assert other.scope("llama-3-8b") != IDS.scope("llama-3-8b")
    swapped = rid.replace(IDS.scope("llama-3-8b"), IDS.scope("llama-3-70b"))
    assert not IDS.owned_by(swapped, "alice")
    mimic = "x_" + IDS.scope("llama-3-8b")  # a client's request_id ending like a scope
    for plain in (IDS.mint("alice"), IDS.mint("alice", mimic), IDS.mint("alice", mimic + "_" + "s" * 8)):
        assert IDS.scope_of(plain) is None
    assert IDS.scope_of(IDS.mint("alice", mimic, model="e5")) == IDS.scope("e5")


def test_anything_else_is_owned_by_no_one() -> None:
    rid = IDS.mint("alice")
    flipped = [rid[:i] + ("a" if rid[i] != "a" else "b") + rid[i + 1 :] for i in range(len(rid))]
    others: list[object] = [
        *flipped,
        rid[:-1],
        rid + "a",
        rid[: -TAG_CHARS - 1],
        rid.upper(),
        rid[-TAG_CHARS:],
        "_" + rid[-TAG_CHARS:],
        "resp_" + "0" * 32,
        "",
        "é" * 62,
        rid[:-1] + "é",
        "x" * (MAX_RESPONSE_ID_CHARS + 1),
        None,
        7,
        [rid],
    ]
    assert not any(IDS.owned_by(other, "alice") for other in others)


@given(tenants, tenants, stems)
def test_an_id_verifies_for_its_tenant_and_for_no_other(alice: str, bob: str, stem: str) -> None:
    rid = IDS.mint(alice, stem)
    assert valid_response_id(rid) and rid.startswith(stem + "_")
    assert IDS.owned_by(rid, alice)
    assert IDS.owned_by(rid, bob) == (alice == bob)


@given(tenants, stems, tenants, stems)
def test_no_two_ids_collide(alice: str, stem_a: str, bob: str, stem_b: str) -> None:
    """Two tenants', or one tenant's sent the same `request_id` twice."""
    assert IDS.mint(alice, stem_a) != IDS.mint(bob, stem_b)
