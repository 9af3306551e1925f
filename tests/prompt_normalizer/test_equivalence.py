"""Equivalence: the seeded corpus gives exactly the outputs recorded in `data/equivalence_goldens.json`.

The goldens were recorded from the normalizer at git `c87917e` (before the per-request speed work
that followed) by this module's `write_goldens`:

    .venv/bin/python -m tests.prompt_normalizer.test_equivalence --write

Each config runs the corpus (`equivalence_corpus.py`) twice through one `Normalizer`, so the second
pass meets every memory warm (chain roots, remembered immutable keys, compiled templates, sessions).
Every output is serialized canonically (every `CanonicalPrompt` field, the render plan, or the
error's message, param and code) and stored as a short keyed digest per case. A speed change must
leave every digest as it is; re-record only for an intended change of behaviour, and say so.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest

from prompt_normalizer.normalizer import Normalizer
from tests.prompt_normalizer.equivalence_corpus import N_REQUESTS, SECRET, SEED, configs, corpus
from tests.prompt_normalizer.equivalence_records import digest, run_case
from tests.prompt_normalizer.tiny_model import build_tiny_model

GOLDENS = Path(__file__).parent / "data" / "equivalence_goldens.json"
PASSES = 2


def outputs(tokenizer_dir: Path) -> dict[str, list[str]]:
    """Per config, one entry per call: the digests of its records joined by '+'."""
    cases = corpus()
    out: dict[str, list[str]] = {}
    for name, config in configs(tokenizer_dir).items():
        norm = Normalizer(config, SECRET)
        got: list[str] = []
        for _ in range(PASSES):
            for case in cases:
                before = copy.deepcopy(case.body)
                got.append("+".join(digest(record) for record in run_case(norm, case)))
                assert case.body == before, "the caller's body was mutated"
        out[name] = got
    return out


def _describe(index: int) -> str:
    case = corpus()[index % N_REQUESTS]
    public = ", public" if case.public else ""
    return f"case {index % N_REQUESTS} (pass {index // N_REQUESTS}): {case.endpoint} {case.tags}{public}"


@pytest.mark.slow
def test_outputs_equal_the_recorded_goldens(tiny_model_dir: Path) -> None:
    recorded = orjson.loads(GOLDENS.read_bytes())
    assert (recorded["seed"], recorded["n_requests"], recorded["passes"]) == (SEED, N_REQUESTS, PASSES)
    got = outputs(tiny_model_dir)
    assert sorted(got) == sorted(recorded["digests"])
    mismatches = [
        f"{name} {_describe(i)}"
        for name, digests in got.items()
        for i, (a, b) in enumerate(zip(digests, recorded["digests"][name].split(), strict=True))
        if a != b
    ]
    assert not mismatches, f"{len(mismatches)} outputs changed:\n" + "\n".join(mismatches[:40])


def test_corpus_covers_what_canonicalization_touches(tiny_model_dir: Path) -> None:
    """The goldens only prove something if the corpus reaches the interesting paths."""
    recorded = orjson.loads(GOLDENS.read_bytes())["digests"]
    cases = corpus()
    tags = {tag for case in cases for tag in case.tags}
    assert {"chat", "completions", "session", "bad_prompt", "role_missing", "not_json_set"} <= tags
    first_pass = recorded["demo"].split()[:N_REQUESTS]
    assert len(set(first_pass)) > 0.8 * N_REQUESTS  # distinct outputs, not one error repeated
    assert sum(case.public for case in cases) > 50


def write_goldens(path: Path = GOLDENS) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        got = outputs(build_tiny_model(Path(tmp) / "tiny-model"))
    record: dict[str, Any] = {
        "seed": SEED,
        "n_requests": N_REQUESTS,
        "passes": PASSES,
        "digests": {name: " ".join(digests) for name, digests in got.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.prompt_normalizer.test_equivalence --write")
    write_goldens()
