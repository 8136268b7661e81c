"""Fault injection: kill a step program with SIGKILL at a named point, once.

Set ``LORAFLOW_FAULT=POINT`` (comma-separated for several) and ``LORAFLOW_FAULT_STATE=DIR`` in the
environment of a step program. The first time execution reaches ``POINT`` the process kills itself
with SIGKILL, as a preempted host or an OOM kill would; a marker in ``DIR`` makes the retry run
through. ``POINT@N`` fires at the N-th time the point is reached in the process (default 1).
Points in the code: ``mid_upload`` (after the first file of an output is uploaded),
``before_manifest`` (every file uploaded, manifest not yet written), ``mid_training`` (after the first
checkpoint of lora_sft), ``checkpoint_upload`` (while a training checkpoint is being persisted),
``mid_merge`` (after the first merged tensor). Without the variables this is a no-op.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

_hits: dict[str, int] = {}


def _armed(name: str) -> int | None:
    """The hit count at which ``name`` fires, or None when it is not armed."""
    for entry in os.environ.get("LORAFLOW_FAULT", "").split(","):
        point_name, _, nth = entry.strip().partition("@")
        if point_name == name:
            return int(nth) if nth else 1
    return None


def point(name: str) -> None:
    nth = _armed(name)
    if nth is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != nth:
        return
    state = Path(os.environ.get("LORAFLOW_FAULT_STATE", "/tmp/loraflow-faults"))
    state.mkdir(parents=True, exist_ok=True)
    marker = state / name
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    print(f"[fault] injected SIGKILL at {name}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
