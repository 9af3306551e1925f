"""What says a watched file changed (the policy file, a workers file): its modification and change
times, size and inode. A rewrite in place changes the times and maybe the size; a replacement by
rename (a ConfigMap update, an atomic deploy) changes the inode."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileStamp:
    mtime_ns: int
    ctime_ns: int
    size: int
    inode: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def stamp(path: str | os.PathLike[str]) -> FileStamp:
    """The stamp of the file at `path` now (raises `OSError` as `os.stat` does)."""
    return FileStamp.of(os.stat(path))
