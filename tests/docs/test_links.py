"""Every relative link between the README and docs/ reaches a file, and every `#anchor` a heading
of the page it names (GitHub's heading ids)."""

from __future__ import annotations

import re
from collections import Counter
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than `-` and `_` dropped, spaces
    turned into `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """The heading ids of `page`; a repeated heading's later ids end in `-1`, `-2`, ..."""
    ids: set[str] = set()
    seen: Counter[str] = Counter()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCED.sub("", page.read_text()), re.M):
        base = slug(heading)
        ids.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return frozenset(ids)


def test_the_slug_is_githubs() -> None:
    assert slug("Probes, shutdown") == "probes-shutdown"
    assert slug("Prefill/decode pools") == "prefilldecode-pools"
    assert slug("Configuration reference (`normalizer:` in the policy YAML)") == (
        "configuration-reference-normalizer-in-the-policy-yaml"
    )


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
