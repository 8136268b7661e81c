"""Fault injection: kill a step program with SIGKILL at a named point, once.

Set ``LORAFLOW_FAULT`` and ``LORAFLOW_FAULT_STATE=DIR`` in the environment of a step program.
``LORAFLOW_FAULT`` is a comma-separated list of entries ``[STAGE:]POINT[@N]``. The N-th time (default
1) execution reaches ``POINT`` in a process the process kills itself with SIGKILL, as a preempted host
or an OOM kill would; a marker file per entry in ``DIR`` makes the retry run through. An entry with a
``STAGE:`` fires only in the step program writing that stage (the last segment of its ``--output``
prefix, so ``evaluate_base`` and ``evaluate_tuned`` are told apart); one without fires in whichever
step reaches the point first. So one pipeline run can kill every stage once, e.g.
``LORAFLOW_FAULT=validate_data:before_manifest,lora_sft:mid_training,merge_adapter:mid_merge``.

Points in the code: ``mid_upload`` (after the first file of an output is uploaded),
``before_manifest`` (every file uploaded, manifest not yet written: reached by every stage),
``mid_training`` (after each checkpoint of lora_sft reached GCS), ``checkpoint_upload`` (a training
checkpoint's files uploaded, its completion marker not yet), ``mid_merge`` (after the first merged
tensor). Without the variables this is a no-op.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

_hits: dict[str, int] = {}


def _stage() -> str | None:
    """The stage this step program writes: the last segment of its ``--output`` prefix."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--output" and i + 1 < len(argv):
            return argv[i + 1].rstrip("/").rsplit("/", 1)[-1]
        if arg.startswith("--output="):
            return arg.split("=", 1)[1].rstrip("/").rsplit("/", 1)[-1]
    return None


def armed(name: str, stage: str | None) -> list[tuple[str, int]]:
    """The entries arming point ``name`` in ``stage``: (marker name, hit count at which it fires)."""
    found = []
    for entry in os.environ.get("LORAFLOW_FAULT", "").split(","):
        target, _, nth = entry.strip().partition("@")
        scope, sep, point_name = target.rpartition(":")
        if point_name != name or (sep and scope != stage):
            continue
        found.append((f"{scope}.{point_name}" if sep else point_name, int(nth) if nth else 1))
    return found


def point(name: str) -> None:
    entries = armed(name, _stage()) if os.environ.get("LORAFLOW_FAULT") else []
    if not entries:
        return
    _hits[name] = _hits.get(name, 0) + 1
    state = Path(os.environ.get("LORAFLOW_FAULT_STATE", "/tmp/loraflow-faults"))
    for marker_name, nth in entries:
        if _hits[name] != nth:
            continue
        state.mkdir(parents=True, exist_ok=True)
        marker = state / marker_name
        try:  # create-only: of two processes reaching the point together, one dies
            with open(marker, "x") as fh:
                fh.write(str(os.getpid()))
        except FileExistsError:
            continue
        print(f"[fault] injected SIGKILL at {marker_name.replace('.', ':')}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
