"""Where a process's threads were, sampled: for finding what a slow training step waited for.

``check.py --probe`` puts this folder first on the case processes' PYTHONPATH, so Python imports this module
at start-up, and sets ``LORAFLOW_PROBE`` to a folder. Then a daemon thread looks at every thread's innermost
frames every ``LORAFLOW_PROBE_INTERVAL`` seconds (0.01) and writes ``probe-<pid>.jsonl`` there, one line per
run of samples in which the main thread stood at the same place:

    {"t": epoch seconds of its first sample, "s": seconds it lasted, "n": samples, "late": the longest delay
     of a sample past its interval (the sampler could not run: the interpreter lock was held, a garbage
     collection ran, or the process stood), "main": the main thread's frames, innermost first,
     "threads": {name: frames} of the others at its first sample}

one line per full garbage collection: ``{"t": ..., "gc2": seconds, "collected": objects}``, and, once the
process has imported JAX, one line per timed JAX event of at least ``JAX_EVENT_MIN_S`` (a trace, a lowering, a
compile, a cache read: ``jax.monitoring``'s duration events) as it ends: ``{"t": ..., "jax": event, "s":
seconds}``: a step that compiled something is told apart from one that waited for something else. Lines are
written as they end (line-buffered), so a process that leaves through ``os._exit`` loses at most one run.
``bench/tpu/probe_report.py`` reads them. Without ``LORAFLOW_PROBE`` this module does nothing. It takes the
place of any other ``sitecustomize`` (the carried environment has none).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Any, TextIO

DEPTH = 8  # frames kept of the main thread
OTHER_DEPTH = 4  # of every other thread
HOLD_S = 60.0  # the switch interval while the sampler holds other threads' frames: longer than it holds them
JAX_EVENT_MIN_S = 0.05  # JAX's timed events written when at least this long (it times thousands of short ones)


def _frames(frame: Any, depth: int) -> list[str]:
    """``file:line function`` of ``frame`` and its callers, innermost first, at most ``depth``."""
    out: list[str] = []
    while frame is not None and len(out) < depth:
        out.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return out


def _where(main: int | None, own: int | None) -> tuple[list[str], dict[str, list[str]]]:
    """The main thread's frames and every other thread's (but the sampler's own), by thread name.

    No other thread runs while this one holds their frames: a frame that returns while another thread holds
    it keeps its locals alive past the return and frees them later, in that thread, in an order its code never
    chose. On the chip (CPython 3.12.1) that killed both sampled lora_sft processes as their first step began:
    "deallocated BytesIO object has exported buffers", then SIGSEGV in the sampler's thread
    (bench/notes.md section 15). So the interpreter is not asked to switch threads until they are let go
    (nothing in between blocks or lets go of the GIL itself)."""
    names = {t.ident: t.name for t in threading.enumerate()}  # takes a lock: outside the window
    switch = sys.getswitchinterval()
    sys.setswitchinterval(HOLD_S)
    try:
        current = sys._current_frames()
        stack = _frames(current.get(main) if main is not None else None, DEPTH)
        others = {
            names.get(ident, str(ident)): _frames(frame, OTHER_DEPTH)
            for ident, frame in current.items()
            if ident not in (main, own)
        }
        del current
    finally:
        sys.setswitchinterval(switch)
    return stack, others


def _sample(out: TextIO, interval: float) -> None:
    main = threading.main_thread().ident
    own = threading.get_ident()
    run: dict[str, Any] | None = None
    due = time.monotonic() + interval
    watching_jax = False
    while True:
        time.sleep(max(0.0, due - time.monotonic()))
        if not watching_jax:
            watching_jax = _watch_jax(out, sys.modules.get("jax.monitoring"))
        now = time.monotonic()
        late = now - due
        due = now + interval
        stack, others = _where(main, own)
        if run is not None and run["main"] == stack and now - run["_start"] < 1.0:
            run["n"] += 1
            run["late"] = max(run["late"], round(late, 4))
            run["s"] = round(now - run["_start"], 4)
            continue
        if run is not None:
            out.write(json.dumps({k: v for k, v in run.items() if not k.startswith("_")}) + "\n")
        run = {"t": round(time.time(), 4), "s": 0.0, "n": 1, "late": round(late, 4), "main": stack}
        run["threads"], run["_start"] = others, now


def _collections(out: TextIO) -> None:
    started: dict[str, float] = {}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started["at"] = time.monotonic()
        elif "at" in started:
            took = time.monotonic() - started.pop("at")
            out.write(
                json.dumps({"t": round(time.time(), 4), "gc2": round(took, 4), "collected": info.get("collected")})
                + "\n"
            )

    gc.callbacks.append(timed)


def _watch_jax(out: TextIO, monitoring: Any) -> bool:
    """Whether JAX's timed events are now written to ``out``: once ``monitoring`` (``jax.monitoring``, looked
    up in ``sys.modules`` by the sampler: the probe imports nothing itself) can register a listener."""
    register = getattr(monitoring, "register_event_duration_secs_listener", None)
    if register is None:  # not imported yet, or still being imported
        return False

    def timed(event: str, duration_secs: float, **_: Any) -> None:
        if duration_secs >= JAX_EVENT_MIN_S:
            out.write(json.dumps({"t": round(time.time(), 4), "jax": event, "s": round(duration_secs, 4)}) + "\n")

    register(timed)
    return True


def _start(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    out = open(os.path.join(folder, f"probe-{os.getpid()}.jsonl"), "a", buffering=1)  # open for the process's life
    out.write(json.dumps({"t": round(time.time(), 4), "argv": sys.argv[:3]}) + "\n")
    _collections(out)
    interval = float(os.environ.get("LORAFLOW_PROBE_INTERVAL", "0.01"))
    threading.Thread(target=_sample, args=(out, interval), name="loraflow-probe", daemon=True).start()


if os.environ.get("LORAFLOW_PROBE"):
    _start(os.environ["LORAFLOW_PROBE"])
