"""The sync token the chart generates for its broker: kept across upgrades by reading it back from
the cluster, in an immutable Secret, so that a renderer without the cluster (`helm template`,
Argo CD), which makes a new token at every render, cannot replace the one the running broker and
gateways hold; a given token has a Secret of its own name. The cluster is played by a copy of the
chart whose `lookup` of Secrets answers from a dict."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python
import pytest

from tests.helm.chart import CHART, RELEASE, REQUIRED, notes, render, render_raw

GENERATED = f"{RELEASE}-kvgate-sync-token"
GIVEN = f"{GENERATED}-given"
LOOKUP = re.compile(
    r'lookup "v1" "Secret" \.Release\.Namespace (\$name|\(include "kvgate\.syncTokenGivenName" \.\))'
)


def token_of(docs: dict[str, dict[str, Any]], name: str, key: str = "token") -> str:
    return base64.b64decode(docs[f"Secret/{name}"]["data"][key]).decode()


def secret(token: str, immutable: bool, key: str = "token") -> dict[str, Any]:
    """A Secret as `lookup` returns it."""
    found: dict[str, Any] = {"data": {key: base64.b64encode(token.encode()).decode()}}
    if immutable:
        found["immutable"] = True
    return found


def with_cluster(tmp_path: Path, secrets: dict[str, dict[str, Any]]) -> Path:
    """A copy of the chart whose lookups of Secrets find `secrets` (by name) and nothing else."""
    chart = tmp_path / "kvgate"
    shutil.copytree(CHART, chart)
    template = chart / "templates" / "sync-token-secret.yaml"
    text, count = LOOKUP.subn(
        r'(get (include "test.secrets" $ | fromJson) \1 | default dict)', template.read_text()
    )
    assert count == 3, "the chart's lookups of the token Secret moved: update this test"
    template.write_text(text)
    (chart / "templates" / "_test_secrets.tpl").write_text(
        '{{- define "test.secrets" -}}' + json.dumps(secrets) + "{{- end }}\n"
    )
    return chart


def test_a_generated_token_is_in_an_immutable_secret_a_given_one_is_not() -> None:
    docs = render()
    generated = docs[f"Secret/{GENERATED}"]
    assert generated["immutable"] is True
    assert "sync.auth.existingSecret" in generated["metadata"]["annotations"]["kvgate.io/sync-token"]
    # Without the cluster, every render makes another.
    assert token_of(docs, GENERATED) != token_of(render(), GENERATED)
    # A token of the operator's may be rotated (both roll): a Secret of another name, not immutable,
    # so that going from a generated token to a given one never rewrites the immutable Secret.
    docs = render({"sync": {"auth": {"token": "a1" * 20}}})
    assert f"Secret/{GENERATED}" not in docs
    assert "immutable" not in docs[f"Secret/{GIVEN}"]
    assert "annotations" not in docs[f"Secret/{GIVEN}"]["metadata"]


def test_an_upgrade_keeps_the_generated_token(tmp_path: Path) -> None:
    kept = "k" * 48
    chart = with_cluster(tmp_path, {GENERATED: secret(kept, immutable=True)})
    docs = render_raw(REQUIRED, chart_dir=chart)
    assert token_of(docs, GENERATED) == kept and docs[f"Secret/{GENERATED}"]["immutable"] is True
    # A Secret of an earlier chart, not yet immutable: kept too, and made immutable.
    chart = with_cluster(tmp_path / "earlier", {GENERATED: secret(kept, immutable=False)})
    docs = render_raw(REQUIRED, chart_dir=chart)
    assert token_of(docs, GENERATED) == kept and docs[f"Secret/{GENERATED}"]["immutable"] is True


def test_after_a_given_token_the_generated_one_keeps_it(tmp_path: Path) -> None:
    """Dropping sync.auth.token keeps the token the broker and gateways hold, when the chart's
    broker can read it; one it cannot (an external broker's) is replaced."""
    given = "g1" * 20
    chart = with_cluster(tmp_path, {GIVEN: secret(given, immutable=False)})
    assert token_of(render_raw(REQUIRED, chart_dir=chart), GENERATED) == given
    chart = with_cluster(tmp_path / "external", {GIVEN: secret("any printable token", immutable=False)})
    replaced = token_of(render_raw(REQUIRED, chart_dir=chart), GENERATED)
    assert len(replaced) == 48 and replaced.isalnum()


def test_a_changed_token_key_cannot_rewrite_the_immutable_secret(tmp_path: Path) -> None:
    chart = with_cluster(tmp_path, {GENERATED: secret("k" * 48, immutable=True)})
    values = REQUIRED | {"sync": {"auth": {"tokenKey": "nats-token"}}}
    with pytest.raises(
        helm_python.HelmError, match=r'sync\.auth\.tokenKey "nats-token": .* immutable .*delete'
    ):
        render_raw(values, chart_dir=chart)
    # Not yet immutable (an earlier chart's): a new token under the new key, as before.
    chart = with_cluster(tmp_path / "earlier", {GENERATED: secret("k" * 48, immutable=False)})
    docs = render_raw(values, chart_dir=chart)
    assert len(token_of(docs, GENERATED, "nats-token")) == 48


def test_the_install_notes_say_where_a_generated_token_cannot_be_kept() -> None:
    text = " ".join(notes().split())
    assert f"generated by the chart (Secret {GENERATED}, immutable)" in text
    assert "Rendered without the cluster (helm template, Argo CD" in text
    assert "sync.auth.existingSecret" in text
    for values in (
        {"sync": {"auth": {"token": "a1" * 20}}},
        {"sync": {"auth": {"existingSecret": "nats-token"}}},
        {"sync": {"auth": {"existingSecret": GENERATED}}},  # a Secret of one's own of that name
        {"sync": {"url": "nats://nats.messaging.svc:4222"}},
        {"sync": {"enabled": False}, "replicaCount": 1},
    ):
        assert "generated by the chart" not in notes(values), values


def test_an_existing_secret_that_this_release_made_is_refused(tmp_path: Path) -> None:
    """Naming the chart's own generated Secret as `existingSecret` (the token a running release
    already has) would have the upgrade delete it: refused. A Secret of that name that the
    operator made (no release owns it) is theirs to name."""
    made = secret("k" * 48, immutable=True) | {
        "metadata": {"annotations": {"meta.helm.sh/release-name": RELEASE}}
    }
    values = REQUIRED | {"sync": {"auth": {"existingSecret": GENERATED}}}
    chart = with_cluster(tmp_path, {GENERATED: made})
    with pytest.raises(helm_python.HelmError, match=r"this release's own sync token Secret"):
        render_raw(values, chart_dir=chart)
    chart = with_cluster(tmp_path / "own", {GENERATED: secret("k" * 48, immutable=False)})
    assert f"Secret/{GENERATED}" not in render_raw(values, chart_dir=chart)
