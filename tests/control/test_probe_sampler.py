"""bench/tpu/probe's sampler (check.py --probe): where a process's threads stand, read without letting the
sampled threads run while their frames are held (a frame freed later in the sampler's thread crashed both
sampled processes on the chip: bench/notes.md section 15)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

PROBE = Path(__file__).resolve().parents[2] / "bench" / "tpu" / "probe" / "sitecustomize.py"


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("LORAFLOW_PROBE", raising=False)  # imported, it samples nothing
    spec = importlib.util.spec_from_file_location("loraflow_probe_under_test", PROBE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_frames_are_read_with_thread_switches_held_off_and_the_interval_restored(
    probe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    switches: list[float] = []
    interval = sys.getswitchinterval()
    read_frames = sys._current_frames
    held_while_read: list[float] = []

    def setswitchinterval(value: float) -> None:
        switches.append(value)

    def current_frames() -> dict[int, Any]:
        held_while_read.append(switches[-1] if switches else interval)
        return read_frames()

    monkeypatch.setattr(probe.sys, "setswitchinterval", setswitchinterval)
    monkeypatch.setattr(probe.sys, "_current_frames", current_frames)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="waiting-worker")
    worker.start()
    try:
        stack, others = probe._where(threading.main_thread().ident, None)
    finally:
        stop.set()
        worker.join()
    assert held_while_read == [probe.HOLD_S] and probe.HOLD_S >= 1.0
    assert switches == [probe.HOLD_S, interval]  # put back as it was
    # the main thread (this one) stood in the read itself, called from _where, called from this test
    assert stack[0].endswith(" current_frames") and stack[1].startswith("sitecustomize.py:")
    assert stack[1].endswith(" _where") and stack[2].endswith(" " + sys._getframe().f_code.co_name)
    assert "waiting-worker" in others and others["waiting-worker"][0].startswith("threading.py:")


def test_the_interval_is_restored_when_reading_fails(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    interval = sys.getswitchinterval()

    def broken() -> dict[int, Any]:
        raise RuntimeError("no frames")

    monkeypatch.setattr(probe.sys, "_current_frames", broken)
    with pytest.raises(RuntimeError, match="no frames"):
        probe._where(threading.main_thread().ident, None)
    assert sys.getswitchinterval() == interval
