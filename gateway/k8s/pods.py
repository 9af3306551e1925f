"""From a Pod object (the API server's JSON) to the endpoint the gateway routes to, or to nothing.

A pod receives traffic only when it is Running, has an IP, has condition Ready=True and is not
being deleted: the same pods a Service would send traffic to (a terminating pod may still report
Ready while it drains, and must get no new requests). Everything is read defensively: a field
that is missing or of the wrong type makes the pod unroutable, never an exception.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.discovery import WorkerDetails
from gateway.worker_sources import worker_url

# What an annotation's endpoint must look like once `{host}` is filled in: a scheme, then no
# spaces and no braces (a `{` left over is a placeholder this reader does not fill).
_ENDPOINT = re.compile(r"^[a-z][a-z0-9+.-]*://[^\s{}]+$")


@dataclass(frozen=True, slots=True)
class PodSettings:
    """What the pool's `kubernetes` block says about reading its pods."""

    port: int | str
    scheme: str = "http"
    kv_events_port: int | str | None = None
    kv_events_annotation: str | None = None
    role_label: str | None = None


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """A routable pod: its worker URL and details."""

    url: str
    details: WorkerDetails


@dataclass(frozen=True, slots=True)
class PodVerdict:
    """What a pod means for routing. `problem` names a mismatch between the pod and the settings
    (a port name it lacks, an annotation that is not an endpoint): worth one warning per pod."""

    endpoint: PodEndpoint | None
    problem: str | None = None


def _map(obj: object, key: str) -> Mapping[str, Any]:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _list(obj: Mapping[str, Any], key: str) -> list[Any]:
    value = obj.get(key)
    return value if isinstance(value, list) else []


def pod_name(pod: object) -> str | None:
    name = _map(pod, "metadata").get("name")
    return name if isinstance(name, str) and name else None


def resource_version(obj: object) -> str | None:
    rv = _map(obj, "metadata").get("resourceVersion")
    return rv if isinstance(rv, str) and rv else None


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready=True, not terminating."""
    if _map(pod, "metadata").get("deletionTimestamp"):
        return False
    status = _map(pod, "status")
    if status.get("phase") != "Running":
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in _list(status, "conditions")
    )


def container_port(pod: Mapping[str, Any], port: int | str) -> int | None:
    """A port number as is; a port name looked up in the pod's containers (None: no such port)."""
    if isinstance(port, int):
        return port
    for container in _list(_map(pod, "spec"), "containers"):
        if not isinstance(container, Mapping):
            continue
        for p in _list(container, "ports"):
            if not isinstance(p, Mapping) or p.get("name") != port:
                continue
            number = p.get("containerPort")
            if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536:
                return number
    return None


def _kv_endpoint(pod: Mapping[str, Any], ip: str, settings: PodSettings) -> tuple[str | None, str | None]:
    """The pod's KV-event endpoint and a problem, from a port (number or name) or an annotation
    whose value is a port number or an endpoint (`tcp://{host}:5557`, `{host}` = the pod's IP)."""
    host = f"[{ip}]" if ":" in ip else ip
    if settings.kv_events_port is not None:
        number = container_port(pod, settings.kv_events_port)
        if number is None:
            return None, f"no container port named {settings.kv_events_port!r} for KV events"
        return f"tcp://{host}:{number}", None
    if settings.kv_events_annotation is None:
        return None, None
    value = _map(_map(pod, "metadata"), "annotations").get(settings.kv_events_annotation)
    if not isinstance(value, str) or not value.strip():
        return None, None  # this pod publishes no KV events
    value = value.strip()
    if value.isascii() and value.isdigit() and 0 < int(value) < 65536:
        return f"tcp://{host}:{int(value)}", None
    # Plain substitution, never `str.format`: the value is written by whoever deploys the pod, and
    # a format field such as `{host.ip}` or `{host:>99999999}` would raise or allocate.
    endpoint = value.replace("{host}", host)
    if _ENDPOINT.match(endpoint):
        return endpoint, None
    return None, f"annotation {settings.kv_events_annotation} is neither a port nor an endpoint"


def read_pod(pod: Mapping[str, Any], settings: PodSettings) -> PodVerdict:
    """The pod's endpoint when it should receive traffic now."""
    if not is_ready(pod):
        return PodVerdict(None)
    ip = _map(pod, "status").get("podIP")
    if not isinstance(ip, str) or not ip:
        return PodVerdict(None)
    try:
        # The API server checks this; a URL is built from it all the same, so check it here too.
        ip = str(ipaddress.ip_address(ip))
    except ValueError:
        return PodVerdict(None, f"podIP {ip[:64]!r} is not an IP address")
    port = container_port(pod, settings.port)
    if port is None:
        return PodVerdict(None, f"no container port named {settings.port!r}")
    url = worker_url(settings.scheme, ip, port)
    kv, problem = _kv_endpoint(pod, ip, settings)
    role = None
    if settings.role_label is not None:
        value = _map(_map(pod, "metadata"), "labels").get(settings.role_label)
        role = value if isinstance(value, str) and value else None
    return PodVerdict(PodEndpoint(url, WorkerDetails(role=role, kv_events_endpoint=kv)), problem)
