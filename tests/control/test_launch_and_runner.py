"""The local launcher (streams, reports failures, kills the whole process group) and the runner's cache."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from loraflow import artifacts
from loraflow.errors import StepError
from loraflow.launch import LocalLauncher, step_environment

REPO = Path(__file__).resolve().parents[2]


def test_lines_are_streamed_as_they_come() -> None:
    lines: list[tuple[float, str]] = []
    code = "import time\nfor i in range(3):\n    print('step', i, flush=True); time.sleep(0.3)"
    LocalLauncher().run([sys.executable, "-c", code], lambda line: lines.append((time.monotonic(), line)))
    assert [text for _, text in lines] == ["step 0", "step 1", "step 2"]
    assert lines[-1][0] - lines[0][0] > 0.4  # not buffered until exit


def test_a_failing_step_raises_with_its_last_error_line() -> None:
    code = "import sys; print('working'); print('ERROR: the dataset is empty', file=sys.stderr); sys.exit(2)"
    with pytest.raises(StepError, match=r"exit status 2.*the dataset is empty"):
        LocalLauncher().run([sys.executable, "-c", code], lambda line: None)


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that no longer exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_kill_stops_the_step_and_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r} + '.partial', 'w').write(str(child.pid))\n"
        f"import os; os.replace({str(pid_file)!r} + '.partial', {str(pid_file)!r})\n"
        "print('started', flush=True); time.sleep(600)"
    )
    launcher = LocalLauncher()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            launcher.run([sys.executable, "-c", code], lambda line: None)
        except StepError as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), "the step program never started its child"
    child = int(pid_file.read_text())
    launcher.kill()
    thread.join(timeout=30)
    assert errors and "killed by signal" in str(errors[0])
    time.sleep(0.5)
    assert not alive(child)


def test_secrets_of_the_worker_do_not_leak_into_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://user:secret@db/airflow")
    env = step_environment({"EXTRA": "1"})
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in env and env["EXTRA"] == "1"
    assert env["PYTHONPATH"] == str(REPO)


def test_second_run_of_a_stage_is_a_cache_hit(parity_spec) -> None:
    """validate_data through the runner twice: the second time nothing is launched."""
    from loraflow import runner

    spec = parity_spec

    first_log: list[str] = []
    first = runner.run_stage(spec, "validate_data", "run-a", {}, first_log.append)
    assert not first.cached and first.summary["train_rows"] == 2000
    assert any("cache miss" in line for line in first_log)
    second_log: list[str] = []
    second = runner.run_stage(spec, "validate_data", "run-b", {}, second_log.append)
    assert second.cached and second.manifest == first.manifest
    assert any("cache hit" in line for line in second_log)
    assert not any("launching" in line for line in second_log)
    assert artifacts.read_manifest(first.manifest).prefix.endswith("/run-a/validate_data")


def test_a_rerun_on_changed_inputs_in_the_same_run_commits_beside_the_first(parity_spec) -> None:
    """A task cleared and re-run with other inputs (or config) keeps the first commit untouched."""
    from loraflow import runner
    from loraflow.spec import with_overrides

    first = runner.run_stage(parity_spec, "validate_data", "run-c", {}, lambda _: None)
    before = artifacts.read_manifest(first.manifest).data
    changed = with_overrides(parity_spec, {"data.expectations.row_count.min": 50})
    second = runner.run_stage(changed, "validate_data", "run-c", {}, lambda _: None)
    assert not second.cached and second.manifest != first.manifest
    key = artifacts.read_manifest(second.manifest).data["cache_key"]
    assert artifacts.read_manifest(second.manifest).prefix.endswith(f"/run-c/validate_data-{key[:12]}")
    assert artifacts.read_manifest(first.manifest).data == before
    again = runner.run_stage(changed, "validate_data", "run-c", {}, lambda _: None)
    assert again.manifest == second.manifest  # the same key finds its own commit
