"""Rendering the chart for tests: the Helm v4 SDK in-process (no helm binary, no cluster), and strict
validation of every built-in resource against the bundled Kubernetes schemas."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import helm_python  # dev extra: helm-python-sdk (Helm v4 SDK in-process, no helm binary)
import kubernetes_validate  # dev extra: kubernetes-validate (bundled Kubernetes JSON schemas)
import yaml
from helm_python import _native

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvgate"
RELEASE, NAMESPACE = "rel", "llm"
KUBE_VERSIONS = ("1.30.0", "1.33.0")
# Custom resources have no bundled schema; their tests check them by shape instead.
CRD_KINDS = frozenset({"ServiceMonitor", "PodMonitor", "PrometheusRule", "HTTPRoute"})

KEY_HASH = "hmac-sha256:" + "ab" * 32
# values.yaml ships no tenant and no workers (both are deployment-specific): every render adds them.
TENANT: dict[str, Any] = {"name": "team-a", "apiKeyHashes": [KEY_HASH]}
POOL: dict[str, Any] = {
    "name": "default",
    "models": ["my-model"],
    "workers": {"urls": ["http://10.0.0.7:8000"]},
}
# ...nor the key-hash secret: one of keyHashSecret.existingSecret and .value is required; nor an
# image repository with a registry (the default `kvgate` is refused unless image.local is true).
IMAGE: dict[str, Any] = {"repository": "registry.example.com/llm/kvgate"}
REQUIRED: dict[str, Any] = {
    "tenants": [TENANT],
    "pools": [POOL],
    "keyHashSecret": {"existingSecret": f"{RELEASE}-kvgate-key-hash"},
    "image": IMAGE,
}
# Where the pod finds the key-hash secret (keyHashSecret.key is `secret` by default).
KEY_HASH_FILE = "/etc/kvgate/key-hash/secret"

Docs = dict[str, dict[str, Any]]


def render_raw(
    values: dict[str, Any],
    namespace: str = NAMESPACE,
    kube_version: str | None = None,
    chart_dir: Path = CHART,
) -> Docs:
    """Render exactly `values` on top of values.yaml, into `namespace`, for the Kubernetes version
    `kube_version` (None: the SDK's default, a recent one), with the chart in `chart_dir` (a copy
    of it, for a test that changes Chart.yaml). Documents are keyed `Kind/name`, plus
    `@namespace` when they go to a namespace other than the release's."""
    chart = helm_python.Chart.load(str(chart_dir))
    options: dict[str, Any] = {"name": RELEASE, "namespace": namespace, "is_install": True}
    if kube_version is None:
        out = chart.render(values, **options)
    else:
        # The SDK's render options take the version; its Python wrapper does not pass it on.
        options["kube_version"] = kube_version
        raw = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(options))
        out = json.loads(raw)
    docs: Docs = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                key = f"{doc['kind']}/{doc['metadata']['name']}"
                target = doc["metadata"].get("namespace", namespace)
                docs[key if target == namespace else f"{key}@{target}"] = doc
    return docs


def render(
    values: dict[str, Any] | None = None, namespace: str = NAMESPACE, kube_version: str | None = None
) -> Docs:
    """Render with `values` (plus a tenant, a static pool and a key-hash Secret unless given) on
    top of values.yaml."""
    return render_raw({**REQUIRED, **(values or {})}, namespace, kube_version)


def notes(values: dict[str, Any] | None = None) -> str:
    """The install notes (NOTES.txt) rendered like `render(values)`."""
    chart = helm_python.Chart.load(str(CHART))
    out = chart.render({**REQUIRED, **(values or {})}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in out.items() if path.endswith("/NOTES.txt"))


def nested(path: str, value: Any) -> dict[str, Any]:
    """Values setting `value` at a dotted `path` (`"sync.auth.tokenKey"`)."""
    out: dict[str, Any] = {}
    node = out
    steps = path.split(".")
    for step in steps[:-1]:
        node[step] = {}
        node = node[step]
    node[steps[-1]] = value
    return out


def values_file(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "ci" / name).read_text())
    return loaded


def gateway_config_text(docs: Docs) -> str:
    """The rendered gateway.yaml (it sits in a Secret: it carries the tenants' key hashes)."""
    return base64.b64decode(docs[f"Secret/{RELEASE}-kvgate-config"]["data"]["gateway.yaml"]).decode()


def gateway_config(docs: Docs) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(gateway_config_text(docs))
    return cfg


def pod_spec(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = docs[f"Deployment/{RELEASE}-kvgate"]["spec"]["template"]["spec"]
    return spec


def container(docs: Docs) -> dict[str, Any]:
    (c,) = pod_spec(docs)["containers"]
    kvgate: dict[str, Any] = c
    return kvgate


def env(docs: Docs) -> dict[str, dict[str, Any]]:
    """The container's environment by variable name."""
    return {e["name"]: e for e in container(docs).get("env", [])}


def volumes(docs: Docs) -> dict[str, dict[str, Any]]:
    """The pod's volumes by name."""
    return {v["name"]: v for v in pod_spec(docs)["volumes"]}


def mounts(docs: Docs) -> dict[str, dict[str, Any]]:
    """The gateway container's volume mounts by volume name."""
    return {m["name"]: m for m in container(docs)["volumeMounts"]}


def validate_strictly(docs: Docs) -> None:
    """Every built-in resource against the Kubernetes schemas, unknown fields rejected."""
    for version in KUBE_VERSIONS:
        for doc in docs.values():
            if doc["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)
