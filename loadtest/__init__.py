"""Emulated vLLM worker, workloads, trace replay, simulator and benchmark runners."""
