"""The supervisor's side of readiness across `kvgate serve --processes N`
(`gateway.lifecycle.ProcessGroup` is process 0's).

Each child i creates `ready-i` in the group's folder once it is ready; process 0's `/readyz`
answers 503 while another's is missing. The supervisor keeps these rules on the files:
- `ready-i` is removed as soon as child i is seen gone (or killed as hung), and again before it is
  started: process 0 must not answer ready for a process the kernel no longer hands connections
  to, nor for one restarted and still finding its workers;
- while child i is held down (past its restart budget), `ready-i.held` stands beside it, and process
  0 does not wait for it: a held child has no socket, so it gets no connection, and the others
  serve. The marker is created only once `ready-i` is gone, and removed when the hold ends, before
  the child is started again, so a restarted child is waited for until it says it is ready.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from gateway.lifecycle import PEERS_READY_ENV, READY_FILE_ENV, held_file


class ReadyFiles:
    """The `ready-i` files of `folder` for children 0 to n-1, and their held markers."""

    def __init__(self, folder: Path, n: int) -> None:
        self.folder = folder
        self.n = n

    def path(self, i: int) -> Path:
        return self.folder / f"ready-{i}"

    def starting(self, i: int) -> dict[str, str]:
        """Child i is about to start: neither ready nor held from now on until it says it is
        ready. The environment that tells it its file, and process 0 the others'."""
        self.not_ready(i)
        self.released(i)
        env = {READY_FILE_ENV: str(self.path(i))}
        if i == 0:
            env[PEERS_READY_ENV] = json.dumps([str(self.path(j)) for j in range(1, self.n)])
        return env

    def not_ready(self, i: int) -> None:
        self.path(i).unlink(missing_ok=True)

    def held(self, i: int) -> None:
        """Child i, exited, is held down: process 0 stops waiting for it."""
        self.not_ready(i)
        # Without the marker, process 0 waits for it (503) as before: nothing worse than that.
        with contextlib.suppress(OSError):
            held_file(self.path(i)).touch()

    def released(self, i: int) -> None:
        """Child i's hold has ended: it is waited for again until its restart says it is ready."""
        held_file(self.path(i)).unlink(missing_ok=True)
