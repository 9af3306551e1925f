"""Readers for real prefix-cache traces (Mooncake jsonl, kv-cache-tester json) into workload requests."""
