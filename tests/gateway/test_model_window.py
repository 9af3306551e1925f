"""Each model's context window from its workers' `/v1/models` cards (`gateway/model_window.py`):
what an answer yields, how a pool's window follows its workers' reads, and when a worker is due
to be read again."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest

from gateway.bodies import ASSUMED_MAX_MODEL_LEN, output_budget
from gateway.config.pool import PoolConfig
from gateway.errors import ApiError
from gateway.model_window import (
    MAX_MODEL_CARDS,
    MAX_WINDOW_TOKENS,
    ModelWindows,
    PoolWindows,
    parse_windows,
)
from gateway.registry import Pool
from gateway.scrape import WorkerMetrics
from gateway.worker import HealthChange, Worker
from policies.base import WorkerId

W1, W2 = WorkerId("http://w1"), WorkerId("http://w2")


def _answer(*cards: dict[str, Any]) -> bytes:
    return orjson.dumps({"object": "list", "data": list(cards)})


def _card(model: str, window: object, **more: Any) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "vllm", "max_model_len": window, **more}


def _pool(**extra: Any) -> PoolConfig:
    return PoolConfig(name="p", models=["m", "m-sql"], adapters={"m-sql": "sql"}, workers=[W1, W2], **extra)


def test_a_vllm_answer_gives_each_cards_window() -> None:
    raw = _answer(_card("m", 32768, root="/models/m", parent=None), _card("m-sql", 32768, parent="m"))
    assert parse_windows(raw) == ModelWindows({"m": 32768, "m-sql": 32768})


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"<html>not found</html>", "not JSON"),
        (b"", "not JSON"),
        (b"[1, 2]", "no list of model cards"),
        (b'{"object": "list", "data": {"id": "m"}}', "no list of model cards"),
        # Past 64 bits orjson reads a float, which is no token count.
        (b'{"data": [{"id": "m", "max_model_len": 100000000000000000000000}]}', None),
        (b'{"data": [1, "m", null]}', None),  # a list, none of it a card with a window
    ],
)
def test_an_answer_that_is_no_list_of_cards_gives_none(raw: bytes, problem: str | None) -> None:
    assert parse_windows(raw) == ModelWindows({}, problem)


@pytest.mark.parametrize(
    "window", [0, -4096, True, 4096.0, "4096", None, [4096], MAX_WINDOW_TOKENS + 1, 2**63 - 1]
)
def test_a_window_that_is_no_plausible_token_count_is_skipped(window: object) -> None:
    read = parse_windows(_answer(_card("m", window), _card("m2", 8192)))
    assert read.windows == {"m2": 8192}


def test_a_card_without_a_string_id_is_skipped_and_a_model_listed_twice_keeps_its_smaller_window() -> None:
    read = parse_windows(_answer({"id": 7, "max_model_len": 10}, _card("m", 8192), _card("m", 4096), "x"))
    assert read.windows == {"m": 4096}


def test_only_the_first_cards_are_read() -> None:
    cards = [_card(f"a{i}", 100) for i in range(MAX_MODEL_CARDS)]
    read = parse_windows(_answer(*cards, _card("m", 4096)))
    assert len(read.windows) == MAX_MODEL_CARDS and "m" not in read.windows


def test_the_smallest_window_of_the_workers_counts_until_its_worker_leaves() -> None:
    windows = PoolWindows(_pool())
    assert windows.max_model_len == {} and not windows.stated
    windows.note(W1, ModelWindows({"m": 8192, "m-sql": 8192}))
    assert windows.max_model_len == {"m": 8192, "m-sql": 8192}
    windows.note(W2, ModelWindows({"m": 4096, "m-sql": 4096, "other": 2}))  # not the pool's: ignored
    assert windows.max_model_len == {"m": 4096, "m-sql": 4096}
    assert windows.reported(W2) == {"m": 4096, "m-sql": 4096}
    windows.forget(W2)
    assert windows.max_model_len == {"m": 8192, "m-sql": 8192} and windows.reported(W2) is None
    windows.note(W1, ModelWindows(problem="HTTP 404"))  # read again, reports none now
    assert windows.max_model_len == {} and windows.reported(W1) is None


def test_an_adapter_without_a_card_runs_in_its_base_models_window() -> None:
    windows = PoolWindows(_pool())
    windows.note(W1, ModelWindows({"m": 16384}))  # SGLang lists the base model only
    assert windows.max_model_len == {"m": 16384, "m-sql": 16384}
    base_only = PoolWindows(PoolConfig(name="p", models=["a", "b"], workers=[W1]))
    base_only.note(W1, ModelWindows({"a": 16384}))
    assert base_only.max_model_len == {"a": 16384}  # `b` is no adapter: its window is unknown


def test_a_stated_window_wins_and_a_smaller_reported_one_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    windows = PoolWindows(_pool(max_model_len=8192))
    assert windows.stated and windows.max_model_len == {"m": 8192, "m-sql": 8192}
    with caplog.at_level(logging.INFO, logger="kvgate.model_window"):
        windows.note(W1, ModelWindows({"m": 32768}))
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        windows.note(W2, ModelWindows({"m": 4096}))
    assert windows.max_model_len == {"m": 8192, "m-sql": 8192}
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.__dict__["windows"] == {"m": 4096, "m-sql": 4096}
    assert warning.__dict__["max_model_len"] == 8192


def test_the_budget_is_bounded_and_refused_by_the_learned_window() -> None:
    windows = PoolWindows(_pool())
    body = {"model": "m-sql", "max_tokens": 10**15}
    assert output_budget(body, "chat", windows.max_model_len.get("m-sql")) == ASSUMED_MAX_MODEL_LEN
    windows.note(W1, ModelWindows({"m": 4096}))
    with pytest.raises(ApiError) as refused:
        output_budget({**body, "max_tokens": 4097}, "chat", windows.max_model_len.get("m-sql"))
    assert refused.value.code == "integer_above_max_value" and refused.value.param == "max_tokens"
    # vLLM serves the whole window, shortened to what the prompt (a token at least) leaves.
    assert output_budget({**body, "max_tokens": 4096}, "chat", windows.max_model_len.get("m-sql")) == 4095
    assert output_budget({**body, "max_tokens": 4095}, "chat", windows.max_model_len.get("m-sql")) == 4095


def _metrics(start_s: float, queries: float = 10.0) -> WorkerMetrics:
    return WorkerMetrics(engine="vllm", process_start_s=start_s, prefix_cache_queries_tokens=queries)


def test_a_worker_is_due_when_seen_up_back_or_restarted() -> None:
    config = _pool()
    worker = Worker(W1, config)
    assert not worker.window_due
    assert worker.record_health(True, config) is HealthChange.UP and worker.window_due
    worker.window_due = False  # read
    worker.note_metrics(_metrics(1.0), 0.0)
    worker.note_metrics(_metrics(1.0, 20.0), 1.0)  # the same process
    assert not worker.window_due
    worker.note_metrics(_metrics(2.0), 2.0)  # another process at the URL
    assert worker.window_due
    worker.window_due = False
    worker.note_metrics(None, 3.0)
    worker.note_metrics(_metrics(3.0), 4.0)  # nothing to compare with
    assert not worker.window_due
    for _ in range(config.health.failures_to_down):
        worker.record_health(False, config)
    assert not worker.healthy and not worker.window_due
    assert worker.record_health(True, config) is HealthChange.BACK and worker.window_due


def test_a_worker_that_leaves_the_pool_counts_no_more() -> None:
    pool = Pool(_pool())
    pool.windows.note(W1, ModelWindows({"m": 2048}))
    pool.windows.note(W2, ModelWindows({"m": 4096}))
    pool.set_urls([W2])
    assert pool.windows.max_model_len == {"m": 4096, "m-sql": 4096}


@pytest.mark.parametrize(
    ("value", "budget"), [("4000", 4000), (4000.0, 4000), (" 12 ", 12), ("x", 0), (2.5, 0)]
)
def test_a_budget_is_read_as_the_worker_reads_it(value: object, budget: int) -> None:
    # vLLM reads "4000" as 4000 (lax pydantic): the load and the window check count it so too.
    assert output_budget({"model": "m", "max_tokens": value}, "chat", 8192) == budget
    if budget:
        with pytest.raises(ApiError):
            output_budget({"model": "m", "max_tokens": value}, "chat", budget - 1)
