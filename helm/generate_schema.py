"""Write the gateway config's JSON schema into the chart's values.schema.json, so that a misspelt
key under `config`, `pools[].extra` or `pools[].workers.kubernetes.extra` fails `helm install`
instead of crashlooping the pods (the gateway rejects unknown keys at start).

    python helm/generate_schema.py          # rewrite helm/kvgate/values.schema.json
    python helm/generate_schema.py --check  # exit 1 if the committed file is not what this writes

The models' schema (`GatewayConfig.model_json_schema()`) goes under `$defs` as `gateway.<Model>`,
trimmed to what fits values that are merged over the chart's own config:

- no `required`: `config` and `extra` are deep-merged over the generated config, so any subset of
  a block's keys is valid (the gateway still checks the merged whole at start);
- no `default`, `title`, `description` or `format` (annotations; helm's validator would assert
  `format`, the gateway parses timestamps itself);
- a field with a `before` validator (which accepts inputs of other shapes than its type, e.g. a
  Kubernetes selector as a mapping) allows any value.

What stays: every object level's `additionalProperties: false` and property names, and the
leaves' types, enums, bounds and patterns.

The chart's own camelCase values that become a field of the gateway config (`sync.batchMaxItems`
is `sync.batch_max_items`, ...; `BOUNDS`) take that field's bounds, patterns and enums, so that the
schema refuses what the gateway would refuse at start; their types and descriptions stay the chart's.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gateway.config import GatewayConfig

SCHEMA = Path(__file__).resolve().parent / "kvgate" / "values.schema.json"
PREFIX = "gateway."
DROPPED = frozenset({"required", "default", "title", "description", "format"})
# Where in values.schema.json each model is used (a path of `properties`/`items` steps).
USES: dict[tuple[str, ...], tuple[str, str]] = {
    ("properties", "config"): (
        "GatewayConfig",
        "further gateway config keys, deep-merged over the generated ones (schema: gateway/config/)",
    ),
    ("properties", "pools", "items", "properties", "extra"): (
        "PoolConfig",
        "further keys of this pool in the gateway config, deep-merged over the generated ones",
    ),
    (
        "properties",
        "pools",
        "items",
        "properties",
        "workers",
        "properties",
        "kubernetes",
        "properties",
        "extra",
    ): ("KubernetesDiscoveryConfig", "further keys of the gateway config's kubernetes block"),
}

# What a field's schema bounds its values with, besides its type.
BOUND_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    | {"minLength", "maxLength", "pattern", "enum"}
)
_POOL = ("properties", "pools", "items", "properties")
_DNS = (*_POOL, "workers", "properties", "dns", "properties")
_PD = (*_POOL, "pd", "properties")
_TRANSFER = (*_PD, "transfer", "properties")
_TENANT = ("properties", "tenants", "items", "properties")
_SYNC = ("properties", "sync", "properties")
# Chart values that the chart's config template copies into a gateway config field: (model, field).
BOUNDS: dict[tuple[str, ...], tuple[str, str]] = {
    (*_SYNC, "batchMaxItems"): ("SyncConfig", "batch_max_items"),
    (*_SYNC, "batchIntervalS"): ("SyncConfig", "batch_interval_s"),
    (*_SYNC, "queueMaxItems"): ("SyncConfig", "queue_max_items"),
    (*_SYNC, "loadRefreshS"): ("SyncConfig", "load_refresh_s"),
    (*_SYNC, "peerTimeoutS"): ("SyncConfig", "peer_timeout_s"),
    (*_SYNC, "connectTimeoutS"): ("SyncConfig", "connect_timeout_s"),
    (*_POOL, "name"): ("PoolConfig", "name"),
    (*_DNS, "refreshSeconds"): ("DnsDiscoveryConfig", "refresh_s"),
    (*_DNS, "emptyAfter"): ("DnsDiscoveryConfig", "empty_after"),
    (*_DNS, "emptyAfterSeconds"): ("DnsDiscoveryConfig", "empty_after_s"),
    (*_POOL, "workers", "properties", "kubernetes", "properties", "namespace"): (
        "KubernetesDiscoveryConfig",
        "namespace",
    ),
    (*_PD, "interferenceWeight"): ("PdConfig", "interference_weight"),
    (*_PD, "holderShare"): ("PdConfig", "holder_share"),
    (*_TRANSFER, "setupSeconds"): ("PdTransferConfig", "setup_s"),
    (*_TRANSFER, "bytesPerToken"): ("PdTransferConfig", "bytes_per_token"),
    (*_TRANSFER, "bandwidthBytesPerSecond"): ("PdTransferConfig", "bandwidth_bytes_per_s"),
    (*_TENANT, "name"): ("TenantConfig", "name"),
    (*_TENANT, "weight"): ("TenantConfig", "weight"),
    (*_TENANT, "maxConcurrent"): ("QuotaConfig", "max_concurrent"),
    (*_TENANT, "rpm"): ("QuotaConfig", "rpm"),
    (*_TENANT, "tpm"): ("QuotaConfig", "tpm"),
}


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `root` through its fields' annotations, by class name."""
    found: dict[str, type[BaseModel]] = {}
    pending: list[Any] = [root]
    while pending:
        tp = pending.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if tp.__name__ in found:
                continue
            found[tp.__name__] = tp
            pending.extend(f.annotation for f in tp.model_fields.values())
        else:
            pending.extend(typing.get_args(tp))
            if isinstance(tp, types.UnionType):
                pending.extend(tp.__args__)
    return found


def _loose_fields(model: type[BaseModel]) -> set[str]:
    """Fields whose validators see the raw input (mode before, wrap or plain)."""
    loose: set[str] = set()
    for validator in model.__pydantic_decorators__.field_validators.values():
        if validator.info.mode != "after":
            loose.update(validator.info.fields)
    return loose


def _trim(node: Any) -> Any:
    if isinstance(node, list):
        return [_trim(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref":
            out[key] = value.replace("#/$defs/", f"#/$defs/{PREFIX}")
        elif key == "properties":
            # Property names are data, not keywords: keep every one, trim their schemas.
            out[key] = {name: _trim(sub) for name, sub in value.items()}
        elif key not in DROPPED:
            out[key] = _trim(value)
    return out


def config_defs() -> dict[str, Any]:
    """The gateway config's models as `$defs` entries named `gateway.<Model>`."""
    schema = GatewayConfig.model_json_schema()
    defs: dict[str, Any] = schema.pop("$defs")
    defs[GatewayConfig.__name__] = schema
    models = _models(GatewayConfig)
    for name, model in models.items():
        for field in _loose_fields(model):
            defs[name]["properties"][field] = {}
    return {f"{PREFIX}{name}": _trim(defs[name]) for name in sorted(defs)}


def field_bounds(defs: dict[str, Any], model: str, field: str) -> dict[str, Any]:
    """The bound keywords of a gateway config field's schema (of its one branch that is not null)."""
    schema = defs[f"{PREFIX}{model}"]["properties"][field]
    branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
    if len(branches) != 1:
        raise ValueError(f"{model}.{field}: {len(branches)} schemas besides null, cannot take its bounds")
    return {key: value for key, value in branches[0].items() if key in BOUND_KEYWORDS}


def generated(values_schema: dict[str, Any]) -> dict[str, Any]:
    """`values_schema` with its `gateway.*` definitions and their uses replaced by the current ones."""
    out: dict[str, Any] = json.loads(json.dumps(values_schema))
    kept = {k: v for k, v in out["$defs"].items() if not k.startswith(PREFIX)}
    out["$defs"] = kept | config_defs()
    for path, (model, description) in USES.items():
        parent = out
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = {"$ref": f"#/$defs/{PREFIX}{model}", "description": description}
    for path, (model, field) in BOUNDS.items():
        node = out
        for step in path:
            node = node[step]
        for key in BOUND_KEYWORDS & node.keys():
            del node[key]
        bounds = field_bounds(out["$defs"], model, field)
        # The chart's own keys first (type), the gateway's bounds after them, the description last.
        description = node.pop("description", None)
        node.update(bounds)
        if description is not None:
            node["description"] = description
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed file")
    args = parser.parse_args(argv)
    current = SCHEMA.read_text()
    wanted = render(generated(json.loads(current)))
    if args.check:
        if current != wanted:
            print(f"{SCHEMA} is out of date: run python helm/generate_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
