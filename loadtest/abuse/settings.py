"""How big the suite runs: the full sizes of the reliability checks, or `--quick` ones for tests."""

from __future__ import annotations

from dataclasses import dataclass

MB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Sizes:
    """Connection counts, request counts and the gateway's client deadlines of one run."""

    header_connections: int = 48
    header_bytes: int = 22 * MB
    slow_connections: int = 50
    partial_connections: int = 64
    other_tenant_requests: int = 32
    done_streams: int = 300
    done_concurrency: int = 16
    stream_tokens: int = 96  # about 0.7 s of decode on the default profile, unloaded
    load_streams: int = 96  # the streaming load a worker is killed or stopped under
    load_concurrency: int = 12
    flood_requests: int = 600
    cross_tenant_prompts: int = 8
    drain_streams: int = 8
    pipeline_connections: int = 120  # each writes one burst of pipelined requests
    address_extra_connections: int = 64  # opened by one address past its limit
    header_timeout_s: float = 10.0  # the gateway's defaults
    body_timeout_s: float = 30.0
    capacity_step_s: float = 10.0
    soak_sample_s: float = 60.0
    quick: bool = False


FULL = Sizes()
QUICK = Sizes(
    header_connections=8,
    header_bytes=2 * MB,
    slow_connections=8,
    partial_connections=16,
    other_tenant_requests=8,
    done_streams=32,
    done_concurrency=8,
    stream_tokens=48,
    load_streams=24,
    load_concurrency=6,
    flood_requests=120,
    cross_tenant_prompts=4,
    drain_streams=3,
    pipeline_connections=24,
    address_extra_connections=16,
    header_timeout_s=2.0,
    body_timeout_s=3.0,
    capacity_step_s=3.0,
    soak_sample_s=10.0,
    quick=True,
)
