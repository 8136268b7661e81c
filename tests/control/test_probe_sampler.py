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


def test_jax_s_timed_events_are_written_once_jax_can_take_a_listener_and_only_the_long_ones(
    probe: Any, tmp_path: Path
) -> None:
    """A step that compiled something shows as a "jax" line with its seconds; JAX's many short events do not;
    before JAX is imported (no module, or one still importing) nothing is registered and the sampler asks again."""
    import io
    import json
    from types import SimpleNamespace

    out = io.StringIO()
    assert probe._watch_jax(out, None) is False
    assert probe._watch_jax(out, SimpleNamespace()) is False  # jax.monitoring mid-import: no function yet
    listeners: list[Any] = []
    assert probe._watch_jax(out, SimpleNamespace(register_event_duration_secs_listener=listeners.append)) is True
    [timed] = listeners
    timed("/jax/core/compile/backend_compile_duration", 1.85, fun_name="train_step")
    timed("/jax/core/compile/tracing_duration", probe.JAX_EVENT_MIN_S)
    timed("/jax/core/compile/jaxpr_trace_duration", probe.JAX_EVENT_MIN_S - 0.001)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["jax"], r["s"]) for r in lines] == [
        ("/jax/core/compile/backend_compile_duration", 1.85),
        ("/jax/core/compile/tracing_duration", probe.JAX_EVENT_MIN_S),
    ]
    assert probe.JAX_EVENT_MIN_S == 0.05

    report = Path(__file__).resolve().parents[2] / "bench" / "tpu" / "probe_report.py"
    spec = importlib.util.spec_from_file_location("loraflow_probe_report_under_test", report)
    assert spec is not None and spec.loader is not None
    reporting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reporting)
    start = lines[0]["t"] - 10.0
    (tmp_path / "probe-1.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"t": start, "argv": ["x"]}, *lines]) + "\n"
    )
    text = reporting.report(tmp_path / "probe-1.jsonl", 12, 0.2)
    assert "JAX's timed events (2, in the order they ended):" in text
    assert "  1.850 s ending at +10.0: /jax/core/compile/backend_compile_duration" in text
