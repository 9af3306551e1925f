"""The traces that ship with kvgate, by name.

Every command that takes a trace path takes one of these names too (`load_trace` resolves them). The
files are xz-compressed package data in `data/`; NOTICE at the repository root names each file's
source repository, path, commit and the sha256 of its uncompressed bytes.
"""

from __future__ import annotations

from pathlib import Path

from loadtest.traces.files import TraceFormatError

DATA_DIR = Path(__file__).resolve().parent / "data"

SHIPPED_TRACES: dict[str, str] = {
    "mooncake-conversation": "conversation_trace.jsonl.xz",  # Mooncake FAST'25, 12,031 requests
    "mooncake-synthetic": "synthetic_trace.jsonl.xz",  # Mooncake FAST'25, 3,993 requests
    "kvct-agent": "trace_0256.json.xz",  # kv-cache-tester, one 11.5 h coding-agent session
}


def resolve_trace(path_or_name: str | Path) -> Path:
    """The shipped file for a trace name, else the argument as a path to an existing file.

    A name wins over a file of the same name in the working directory (`./NAME` reads that file).
    """
    if isinstance(path_or_name, str) and path_or_name in SHIPPED_TRACES:
        return DATA_DIR / SHIPPED_TRACES[path_or_name]
    path = Path(path_or_name)
    if not path.is_file():
        names = ", ".join(SHIPPED_TRACES)
        raise TraceFormatError(f"{path}: no such trace file, and not a shipped trace name ({names})")
    return path
