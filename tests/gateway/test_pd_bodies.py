"""What a vLLM prefill leg keeps of the client's request: a `min_tokens` the engine refuses stays,
so the prefill worker refuses the request before it holds any KV. With no budget sent the
engine's own default for the route counts (vLLM's completions and native generate: 16)."""

from __future__ import annotations

from gateway.pd_bodies import _Budget, _refused


def test_min_tokens_past_the_routes_default_budget_is_refused_when_no_budget_is_sent() -> None:
    completions = _Budget(("max_tokens",), 16)
    assert _refused({"min_tokens": 20}, completions)
    assert not _refused({"min_tokens": 16}, completions)
    assert not _refused({"min_tokens": 20, "max_tokens": 32}, completions)
    assert _refused({"min_tokens": 20, "max_tokens": 8}, completions)


def test_a_chat_without_a_budget_is_left_to_its_context_window() -> None:
    chat = _Budget(("max_completion_tokens", "max_tokens"))
    assert not _refused({"min_tokens": 500}, chat)  # the window's rest: not judged here
    assert _refused({"min_tokens": 5, "max_completion_tokens": 4}, chat)
    assert _refused({"max_tokens": 0}, chat)
