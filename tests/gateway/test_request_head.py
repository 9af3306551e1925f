"""The request's head as the hot path reads it (`RequestHead`) and the ids the gateway gives
requests (`new_request_id`)."""

from __future__ import annotations

import os

import pytest

from gateway.request_head import RequestHead, new_request_id
from gateway.routes import ApiRoute


def head_with_length(length: bytes, route: ApiRoute | None = None) -> RequestHead:
    scope = {"headers": [(b"content-length", length), (b"authorization", b"Bearer k")]}
    return RequestHead.of(scope) if route is None else RequestHead.of_route(scope, route)


@pytest.mark.parametrize("route", [None, ApiRoute("messages", "/v1/messages", api_key_header=True)])
def test_a_content_length_of_any_number_of_digits_is_read_without_error(route: ApiRoute | None) -> None:
    # llhttp takes any number of leading zeros; Python refuses int() of more than 4,300 digits.
    assert head_with_length(b"0" * 4999 + b"2", route).content_length == 2
    assert head_with_length(b"0" * 5000, route).content_length == 0
    assert head_with_length(b"0" * 10 + b"1" * 18, route).content_length == int(b"1" * 18)
    # More significant digits than any body limit could allow: a length past every limit.
    huge = head_with_length(b"9" * 5000, route).content_length
    assert huge is not None and huge >= 10**18
    assert head_with_length(b"12", route).content_length == 12
    assert head_with_length(b"-1", route).content_length is None


def test_request_ids_are_random_and_tell_nothing_of_order_or_process() -> None:
    ids = [new_request_id() for _ in range(2000)]  # past one read of the random source
    assert len(set(ids)) == len(ids)
    assert all(len(rid) == 24 and int(rid, 16) >= 0 for rid in ids)
    # A counter behind a fixed prefix would share its first characters across ids.
    assert len({rid[:6] for rid in ids}) > 1900


def test_a_forked_process_does_not_hand_out_its_parents_ids() -> None:
    new_request_id()  # the parent has read its random bytes
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, "".join(new_request_id() for _ in range(8)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        child = pipe.read().decode()
    os.waitpid(pid, 0)
    parent = "".join(new_request_id() for _ in range(8))
    assert len(child) == len(parent) == 8 * 24 and child != parent
