"""`make test`'s lanes (loraflow/dev/lanes.py) with real make on a Makefile of small targets: lanes run
side by side, a lane's targets one after another, every target whatever another's result, held output
printed whole, and SIGTERM ends every target's processes."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loraflow.dev import lanes

REPO = Path(__file__).resolve().parents[2]
# Waits for a file (a guard against a hang, not a measurement: the handshake decides, not the clock).
WAIT_FOR = "for i in $$(seq 1200); do [ -e {path} ] && break; sleep 0.1; done; [ -e {path} ]"


def makefile(folder: Path, recipes: dict[str, str]) -> Path:
    lines = [".PHONY: " + " ".join(recipes)]
    for target, recipe in recipes.items():
        lines += [f"{target}:", f"\t@{recipe}"]
    (folder / "Makefile").write_text("\n".join(lines) + "\n")
    return folder


def run(folder: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    outcomes = lanes.Lanes("make", folder / "logs", out, folder).run(lanes.parse_lanes(list(args)))
    text = out.getvalue() + lanes.summary(outcomes, 1.0, (0.0, 0.0))
    return (0 if all(o.passed for o in outcomes) else 1), text


def test_the_lanes_run_side_by_side(tmp_path: Path) -> None:
    """Each lane's target waits for the other's to start: run one after another, the first would never end."""
    a, b = tmp_path / "a-started", tmp_path / "b-started"
    folder = makefile(
        tmp_path,
        {"a": f"touch {a}; {WAIT_FOR.format(path=b)}", "b": f"touch {b}; {WAIT_FOR.format(path=a)}"},
    )
    assert run(folder, "a", "b")[0] == 0


def test_a_lanes_targets_run_in_order_and_every_target_runs_after_a_failure(tmp_path: Path) -> None:
    order = tmp_path / "order"
    folder = makefile(
        tmp_path,
        {
            "first": f"echo first >> {order}; exit 3",
            "second": f"echo second >> {order}",
            "beside": "echo beside; exit 4",
        },
    )
    status, text = run(folder, "first second", "beside")
    assert status == 1
    assert order.read_text().split() == ["first", "second"]
    table = text[text.index("== make targets") :].splitlines()
    assert [row.split()[:2] for row in table[1:4]] == [["first", "FAILED"], ["second", "passed"], ["beside", "FAILED"]]
    assert "(exit 2)" in table[1] and "(exit 2)" in table[3]  # make's status for a failed recipe


def test_a_held_targets_output_is_printed_whole_between_its_own_header_and_end(tmp_path: Path) -> None:
    """The streamed lane writes lines all the while the held target runs; none lands inside its block."""
    done = tmp_path / "held-done"
    streamed = f"while [ ! -e {done} ]; do echo streamed line; sleep 0.05; done; echo streamed last"
    held = "for i in $$(seq 200); do echo held $$i; done; " + f"touch {done}"
    status, text = run(makefile(tmp_path, {"streamed": streamed, "held": held}), "streamed", "held")
    assert status == 0
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("== held (passed in"))
    assert lines[start + 1 : start + 201] == [f"held {i}" for i in range(1, 201)]
    assert lines[start + 201] == "== end of held"
    assert "streamed last" in lines and (tmp_path / "logs" / "held.log").read_text().count("held") == 200


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["lint test-control", "test-control"], "test-control named twice: name each make target in one lane only"),
        (["lint", " "], "a lane names no make target: give each lane as one argument"),
    ],
)
def test_lanes_that_name_a_target_twice_or_none_are_refused_in_one_line(args: list[str], says: str) -> None:
    with pytest.raises(lanes.LanesError, match=says):
        lanes.parse_lanes(args)
    proc = subprocess.run([sys.executable, "-m", "loraflow.dev.lanes", *args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and says in proc.stderr.strip().splitlines()[-1]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_ends_every_targets_processes_and_exits_1(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    folder = makefile(
        tmp_path,
        {
            "a": f"sleep 600 & echo $$! >> {pids}; wait",
            "b": f"sleep 600 & echo $$! >> {pids}; wait",
            "never": f"echo ran >> {tmp_path / 'never'}",
        },
    )
    argv = [
        sys.executable,
        "-m",
        "loraflow.dev.lanes",
        "-C",
        str(folder),
        "--logs",
        str(folder / "logs"),
        "a never",
        "b",
    ]
    proc = subprocess.Popen(argv, cwd=REPO)
    deadline = time.monotonic() + 120  # a guard against a hang
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    sleepers = [int(pid) for pid in pids.read_text().split()]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 1
    while any(map(running, sleepers)) and time.monotonic() < deadline:
        time.sleep(0.1)  # a killed process lingers until its new parent reaps it
    assert not any(map(running, sleepers))
    assert not (tmp_path / "never").exists()
