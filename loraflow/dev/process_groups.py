"""Ending processes that were started in sessions of their own, with everything they started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from contextlib import suppress


def end_groups(procs: Sequence[subprocess.Popen[bytes]], grace: float = 30) -> None:
    """SIGTERM to every process group at once, SIGKILL to each group left after ``grace`` seconds (a group
    can outlive its leader), then reap each leader. Each process must have been started with
    ``start_new_session=True``: its pid is its group's id."""
    for proc in procs:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
