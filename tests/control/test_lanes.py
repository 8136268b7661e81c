"""`make test`'s lanes (loraflow/dev/lanes.py) with real make on a Makefile of small targets: lanes run
side by side, a lane's targets one after another, every target whatever another's result, held output
printed whole, the exit status 1 when any target failed, --one-lane (make test TEST_LANES=1) one after
another, and SIGTERM ends every target's processes."""

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
    runner = lanes.Lanes("make", folder / "build" / "lanes", out, folder)
    assert runner.run(lanes.parse_lanes(list(args)))
    outcomes = runner.outcomes()
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
            "second": f"echo second >> {order}; sleep 1",
            "beside": "echo beside; exit 4",
        },
    )
    status, text = run(folder, "beside", "first second")  # the held lane (its logs' folder made once)
    assert status == 1
    assert order.read_text().split() == ["first", "second"]
    table = text[text.index("== make targets") :].splitlines()
    assert [row.split()[:2] for row in table[1:4]] == [["beside", "FAILED"], ["first", "FAILED"], ["second", "passed"]]
    assert "(exit 2)" in table[1] and "(exit 2)" in table[2]  # make's status for a failed recipe
    assert 1 <= float(table[3].split()[-2]) < 600  # second's wall: it sleeps 1 s


def test_a_held_targets_output_is_printed_whole_between_its_own_header_and_end(tmp_path: Path) -> None:
    """The streamed lane writes lines all the while the held target runs; none lands inside its block."""
    done = tmp_path / "held-done"
    streamed = f"while [ ! -e {done} ]; do echo streamed line; sleep 0.05; done; echo streamed last"
    held = "for i in $$(seq 200); do echo held $$i; done; echo held on stderr >&2; " + f"touch {done}"
    status, text = run(makefile(tmp_path, {"streamed": streamed, "held": held}), "streamed", "held")
    assert status == 0
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("== held (passed in"))
    assert lines[start + 1 : start + 201] == [f"held {i}" for i in range(1, 201)]
    assert lines[start + 201 : start + 203] == ["held on stderr", "== end of held"]
    assert lines[0] == "== streamed: its output follows as it comes" and "streamed last" in lines
    assert (tmp_path / "build" / "lanes" / "held.log").read_text().count("held") == 201
    assert not (tmp_path / "build" / "lanes" / "streamed.log").exists()


def test_stderr_and_bytes_that_are_not_utf8_are_shown_not_fatal(tmp_path: Path) -> None:
    recipe = "printf 'on stderr \\377\\n' >&2"
    status, text = run(makefile(tmp_path, {"streamed": recipe, "held": recipe}), "streamed", "held")
    assert status == 0
    assert text.count("on stderr \ufffd") == 2


def main(folder: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``lanes.main`` in this process on the folder's Makefile, as make test calls it: its status and output."""
    status = lanes.main(["-C", str(folder), "--logs", str(folder / "logs"), *args])
    return status, capsys.readouterr().out


def lanes_main(folder: Path, *args: str) -> subprocess.Popen[str]:
    """``python -m loraflow.dev.lanes`` on the folder's Makefile, as make test calls it."""
    argv = [sys.executable, "-m", "loraflow.dev.lanes", "-C", str(folder), "--logs", str(folder / "logs"), *args]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("failing", ["streamed", "held"])
def test_the_exit_status_is_1_when_any_target_fails_and_its_output_is_shown_whole(
    tmp_path: Path, failing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """make test (hence .ci/run) fails with it; every line the failing target wrote is in the output."""
    bad = "for i in $$(seq 300); do echo bad $$i; done; exit 1"
    recipes = {"streamed": "echo fine", "held": "echo fine too", failing: bad}
    status, out = main(makefile(tmp_path, recipes), capsys, "streamed", "held")
    assert status == 1
    lines = out.splitlines()
    bad_lines = [f"bad {i}" for i in range(1, 301)]
    if failing == "held":  # one block
        first = lines.index("bad 1")
        assert lines[first : first + 300] == bad_lines
    else:  # streamed as it comes: the held target's block may land between two of its lines
        assert [line for line in lines if line.startswith("bad ")] == bad_lines
    table = lines[lines.index("== make targets, their results and walls") + 1 :]
    assert [row.split()[:2] for row in table[:2]] == [
        ["streamed", "FAILED" if failing == "streamed" else "passed"],
        ["held", "FAILED" if failing == "held" else "passed"],
    ]
    assert table[2].startswith("all lanes: ")
    assert (
        main(makefile(tmp_path, {"streamed": "echo fine", "held": "echo fine too"}), capsys, "streamed", "held")[0] == 0
    )


def test_one_lane_runs_every_target_one_after_another_in_the_order_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``second`` fails unless ``first`` ended before it began: side by side it would start at once."""
    done = tmp_path / "first-done"
    folder = makefile(
        tmp_path,
        {"first": f"sleep 1; touch {done}", "second": f"[ -e {done} ]", "third": "echo third"},
    )
    status, out = main(folder, capsys, "--one-lane", "first", "second third")
    assert status == 0, out
    assert lanes.parse_lanes(["first", "second third"], one_lane=True) == [["first", "second", "third"]]
    # One lane streams: no target's output was held in a log.
    assert [line for line in out.splitlines() if line.startswith("== ") and "follows" in line] == [
        "== first: its output follows as it comes",
        "== second: its output follows as it comes",
        "== third: its output follows as it comes",
    ]
    assert not (folder / "logs").exists()


def test_the_table_gives_the_load_at_the_start_and_the_end_and_is_printed_with_no_target_ended() -> None:
    table = lanes.summary([], 12.4, (3.25, 5.5)).splitlines()
    assert table[0] == "== make targets, their results and walls"
    assert table[1].startswith("all lanes: 12 s on ")
    assert table[1].endswith("1-minute load average 3.2 at the start, 5.5 at the end")
    rows = lanes.summary([lanes.Outcome("lint", 0, 3.0), lanes.Outcome("test-e2e", 2, 65.0)], 65, (0, 0)).splitlines()
    assert rows[1:3] == ["lint      passed                 3 s", "test-e2e  FAILED (exit 2)       65 s"]


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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_ends_every_targets_processes_prints_what_they_wrote_and_exits_1(tmp_path: Path, signum: int) -> None:
    """SIGTERM (CI's timeout) or SIGINT (Ctrl-C: the targets, in sessions of their own, do not get it)."""
    pids = tmp_path / "pids"
    folder = makefile(
        tmp_path,
        {
            "a": f"echo a began; sleep 600 & echo $$! >> {pids}; wait",
            "b": f"echo b began; sleep 600 & echo $$! >> {pids}; wait",
            "never": f"echo ran >> {tmp_path / 'never'}",
        },
    )
    proc = lanes_main(folder, "a never", "b")
    deadline = time.monotonic() + 120  # a guard against a hang
    while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    sleepers = [int(pid) for pid in pids.read_text().split()]
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    while any(map(running, sleepers)) and time.monotonic() < deadline:
        time.sleep(0.1)  # a killed process lingers until its new parent reaps it
    assert not any(map(running, sleepers))
    assert not (tmp_path / "never").exists()
    lines = out.splitlines()
    assert f"stopped ({signal.Signals(signum).name}): ending every target" in lines
    held = next(i for i, line in enumerate(lines) if line.startswith("== b (FAILED"))  # the held target's log
    assert lines[held + 1] == "b began" and "== end of b" in lines[held + 2 :]  # between: what make says of it
    assert "a began" in lines
    table = lines[lines.index("== make targets, their results and walls") + 1 :]
    assert [row.split()[0] for row in table[:2]] == ["a", "b"], out  # the streamed target too
    assert all(row.split()[1] == "FAILED" for row in table[:2])
