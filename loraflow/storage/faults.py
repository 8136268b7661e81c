"""Fault injection: kill a step program with SIGKILL at a named point, once.

Set ``LORAFLOW_FAULT`` and ``LORAFLOW_FAULT_STATE=DIR`` in the environment of a step program.
``LORAFLOW_FAULT`` is a comma-separated list of entries ``[[PIPELINE/]STAGE:]POINT[@N]``. The N-th time
(default 1) execution reaches ``POINT`` in a process the process kills itself with SIGKILL, as a preempted
host or an OOM kill would; a marker file per entry in ``DIR`` makes the retry run through. An entry with a
``STAGE:`` fires only in the step program writing that stage (the last segment of its ``--output``
prefix, so ``evaluate_base`` and ``evaluate_tuned`` are told apart), one with ``PIPELINE/STAGE:`` only
in that stage of that pipeline's runs (the segment two before it: ``{root}/PIPELINE/RUN/STAGE``), so a
stack whose other pipelines run too kills one pipeline's steps alone; one without fires in whichever
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


def _output() -> list[str]:
    """The segments of this step program's ``--output`` prefix (empty when it has none)."""
    argv = sys.argv
    for i, arg in enumerate(argv):
        if arg == "--output" and i + 1 < len(argv):
            return argv[i + 1].rstrip("/").split("/")
        if arg.startswith("--output="):
            return arg.split("=", 1)[1].rstrip("/").split("/")
    return []


def armed(name: str, output: list[str]) -> list[tuple[str, int]]:
    """The entries arming point ``name`` in the step writing ``output`` (its prefix's segments): (the
    entry's target, as written before ``@N``, and the hit count at which it fires)."""
    stage = output[-1] if output else None
    pipeline = output[-3] if len(output) >= 3 else None
    found = []
    for entry in os.environ.get("LORAFLOW_FAULT", "").split(","):
        target, _, nth = entry.strip().partition("@")
        scope, sep, point_name = target.rpartition(":")
        in_pipeline, slash, in_stage = scope.rpartition("/")
        if point_name != name or (sep and in_stage != stage) or (slash and in_pipeline != pipeline):
            continue
        found.append((target, int(nth) if nth else 1))
    return found


def point(name: str) -> None:
    entries = armed(name, _output()) if os.environ.get("LORAFLOW_FAULT") else []
    if not entries:
        return
    _hits[name] = _hits.get(name, 0) + 1
    state = Path(os.environ.get("LORAFLOW_FAULT_STATE", "/tmp/loraflow-faults"))
    for target, nth in entries:
        if _hits[name] != nth:
            continue
        state.mkdir(parents=True, exist_ok=True)
        marker = state / target.replace("/", ".").replace(":", ".")  # e.g. lora_sft.mid_training
        try:  # create-only: of two processes reaching the point together, one dies
            with open(marker, "x") as fh:
                fh.write(str(os.getpid()))
        except FileExistsError:
            continue
        print(f"[fault] injected SIGKILL at {target}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
