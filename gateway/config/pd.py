"""The `pd` block of a pool: prefill/decode disaggregation (docs/pd.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import Frozen, PositiveFloat, PositiveInt
from policies.pd import HOLDER_PREFILL, PAIRS, PdMode


class PdTransferConfig(Frozen):
    """How long moving a request's KV from its prefill worker to its decode worker takes:
    `setup_s + tokens × bytes_per_token / bandwidth_bytes_per_s` (defaults: Llama-3-8B in bf16,
    one 400 Gb/s RDMA link)."""

    setup_s: float = Field(default=0.001, ge=0)
    bytes_per_token: PositiveInt = 131_072
    bandwidth_bytes_per_s: PositiveFloat = 45e9


class PdConfig(Frozen):
    """Prefill/decode disaggregation of a pool (docs/pd.md): the wire protocol the workers speak,
    the transfer model that prices a split, and whether a request may skip the split."""

    protocol: Literal["vllm", "sglang"] = "vllm"
    transfer: PdTransferConfig = PdTransferConfig()
    # SGLang: the prefill workers' bootstrap port (`--disaggregation-bootstrap-port`), and the
    # port of any prefill worker (by URL) that uses another one.
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_ports: dict[str, Annotated[int, Field(ge=1, le=65535)]] = Field(default_factory=dict)
    # Conditional disaggregation: a request may run on one worker alone when that scores better.
    conditional: bool = True
    # Weight of the delay a prefill run on a decode worker imposes on the requests it is decoding.
    interference_weight: float = Field(default=1.0, ge=0)
    # `pairs`: every request of a generation route is scored as a split and alone (the pair
    # chooser, docs/pd.md). `holder_prefill` (vLLM, mixed workers that send and receive KV): a
    # request runs where the routing policy sends it, unless another worker holds more of its
    # prompt, and over `holder_share` of it; then that worker prefills and the best other worker
    # decodes, when that is predicted to finish sooner.
    mode: PdMode = PAIRS
    holder_share: float = Field(default=0.5, ge=0, lt=1)

    @model_validator(mode="after")
    def _holder_protocol(self) -> PdConfig:
        if self.mode == HOLDER_PREFILL and self.protocol != "vllm":
            raise ValueError(
                "pd.mode holder_prefill needs protocol vllm: an SGLang mixed server takes no part in a split"
            )
        return self

    @field_validator("bootstrap_ports")
    @classmethod
    def _port_urls(cls, ports: dict[str, int]) -> dict[str, int]:
        for url in ports:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
        return {u.rstrip("/"): port for u, port in ports.items()}

    def bootstrap_port_of(self, url: str) -> int | None:
        """The bootstrap port of the prefill worker at `url` (SGLang)."""
        return self.bootstrap_ports.get(url, self.bootstrap_port)
