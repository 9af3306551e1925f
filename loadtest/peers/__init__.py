"""Peer routers (sglang-router, vllm-router, LiteLLM): own venvs, launched for benchmarks."""
