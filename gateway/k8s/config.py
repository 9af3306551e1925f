"""The `kubernetes` block of a pool in the gateway config: which pods, which port, where their KV
events are, and how to reach the API server. Parsed with the rest of the config (`gateway.config`);
errors name the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.k8s.selector import label_key_ok, normalize_selector, port_name_ok

PositiveInt = Annotated[int, Field(gt=0)]


def _port(value: object) -> object:
    """A port number, or a container port name (digits-only names are numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("must be a port number or a container port name")
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int):
        if not 1 <= value <= 65535:
            raise ValueError(f"port {value} is out of range 1-65535")
        return value
    if not port_name_ok(value):
        raise ValueError(f"{value!r} is neither a port number nor a container port name")
    return value


class KubernetesDiscoveryConfig(BaseModel):
    """Workers as the ready pods matching `selector` in `namespace`, followed through the API server
    (list + watch of Pods). Each ready pod becomes `scheme://podIP:port`; `port` is a number or the
    name of a container port. In a cluster the service account's token and CA are used; `api_server`
    (with `token_file`, `ca_file`) points elsewhere."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    selector: str
    port: int | str
    scheme: Literal["http", "https"] = "http"
    kv_events_port: int | str | None = None
    kv_events_annotation: str | None = None
    role_label: str | None = None
    api_server: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    max_pods: PositiveInt = 1024
    watch_timeout_s: int = Field(default=300, ge=10, le=3600)

    @field_validator("selector", mode="before")
    @classmethod
    def _selector(cls, value: object) -> str:
        if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
            return normalize_selector(value)
        if isinstance(value, str):
            return normalize_selector(value)
        raise ValueError(
            "must be a label selector string or a mapping of label to string value (quote values "
            "such as 'true' or '1' in YAML)"
        )

    @field_validator("port", "kv_events_port", mode="before")
    @classmethod
    def _ports(cls, value: object) -> object:
        return None if value is None else _port(value)

    @field_validator("kv_events_annotation", "role_label")
    @classmethod
    def _keys(cls, value: str | None) -> str | None:
        if value is not None and not label_key_ok(value):
            raise ValueError(f"{value!r} is not a valid label or annotation key")
        return value

    @field_validator("api_server")
    @classmethod
    def _api(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"api_server {value!r} must start with http:// or https://")
        return value.rstrip("/") if value is not None else None

    @property
    def finds_kv_events(self) -> bool:
        """Whether each pod's KV-event endpoint comes from its ports or annotations."""
        return self.kv_events_port is not None or self.kv_events_annotation is not None

    @model_validator(mode="after")
    def _kv_source(self) -> KubernetesDiscoveryConfig:
        if self.kv_events_port is not None and self.kv_events_annotation is not None:
            raise ValueError("set at most one of kv_events_port and kv_events_annotation")
        return self
