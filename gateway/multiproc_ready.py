"""The supervisor's side of readiness across `kvgate serve --processes N`
(`gateway.lifecycle.ProcessGroup` is process 0's).

Each child i creates `ready-i` in the group's folder once it is ready; process 0's `/readyz`
answers 503 while another's is missing. The supervisor removes `ready-i` as soon as child i is
seen gone (or killed as hung), and again before it is started: process 0 must not answer ready for
a process the kernel no longer hands connections to, nor for one restarted and still finding its
workers.
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.lifecycle import PEERS_READY_ENV, READY_FILE_ENV


class ReadyFiles:
    """The `ready-i` files of `folder` for children 0 to n-1."""

    def __init__(self, folder: Path, n: int) -> None:
        self.folder = folder
        self.n = n

    def path(self, i: int) -> Path:
        return self.folder / f"ready-{i}"

    def starting(self, i: int) -> dict[str, str]:
        """Child i is about to start: not ready from now on until it says it is. The environment
        that tells it its file, and process 0 the others'."""
        self.not_ready(i)
        env = {READY_FILE_ENV: str(self.path(i))}
        if i == 0:
            env[PEERS_READY_ENV] = json.dumps([str(self.path(j)) for j in range(1, self.n)])
        return env

    def not_ready(self, i: int) -> None:
        self.path(i).unlink(missing_ok=True)
