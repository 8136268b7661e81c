"""`make test`'s checks in lanes: the make targets of a lane run one after another, the lanes side by side.

    python -m loraflow.dev.lanes "test-e2e" "lint typecheck test-control test-serving test-trainer"
    python -m loraflow.dev.lanes --one-lane "test-e2e" "lint typecheck ..."   # one after another

A test tier mostly keeps one core busy (one pytest process and the program it waits for), so on 2
cores the end-to-end tier runs beside the others (docs/architecture.md has the measured walls). The
first lane's output streams as it comes, so a CI log shows progress; the other lanes' targets write to
a log file each (``--logs``), printed whole when the target ends, so two targets' lines never mix.
Every target runs whatever another's result; the exit status is 1 when any failed, and a table of
targets, results and walls (with the load average) ends the output. SIGTERM or Ctrl-C ends every
target's process group, prints what the held targets wrote until then and the table, and exits 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from loraflow.dev.process_groups import end_groups


class LanesError(ValueError):
    """Lanes that name no target, or a target twice."""


class Stopped(Exception):
    """A stop under way: no new target starts."""


@dataclass(frozen=True)
class Outcome:
    target: str
    returncode: int
    seconds: float

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def parse_lanes(lanes: list[str], one_lane: bool = False) -> list[list[str]]:
    """Each argument is a lane: make targets separated by spaces; ``one_lane`` puts them all in the first,
    in the order given."""
    parsed = [lane.split() for lane in lanes]
    if not parsed or not all(parsed):
        raise LanesError("a lane names no make target: give each lane as one argument, e.g. 'lint test-control'")
    targets = [target for lane in parsed for target in lane]
    twice = sorted({target for target in targets if targets.count(target) > 1})
    if twice:
        raise LanesError(f"{', '.join(twice)} named twice: name each make target in one lane only")
    return [targets] if one_lane else parsed


class Lanes:
    """Starts the lanes' targets and remembers their processes, so that ``stop`` can end them all."""

    def __init__(self, make: str, logs: Path, out: IO[str], directory: Path | None = None) -> None:
        """``directory``: where make runs (the current directory when None)."""
        self.make, self.logs, self.out, self.directory = make, logs, out, directory
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._outcomes: list[list[Outcome]] = []

    def run(self, lanes: list[list[str]], stop: threading.Event | None = None) -> bool:
        """Runs the lanes until each has ended (True) or ``stop`` is set (False: call ``stop()``)."""
        self._outcomes = [[] for _ in lanes]
        self._threads = [
            threading.Thread(target=self._run_lane, args=(lane, i == 0, self._outcomes[i]), daemon=True)
            for i, lane in enumerate(lanes)
        ]
        for thread in self._threads:
            thread.start()
        # Polls rather than joins: a signal handler that raised inside Thread.join would mark a thread
        # still running as ended (CPython 3.12's join releases the thread's lock when interrupted).
        stop = stop or threading.Event()
        while any(thread.is_alive() for thread in self._threads):
            if stop.wait(0.2):
                return False
        return True

    def outcomes(self) -> list[Outcome]:
        """The targets ended so far, lane by lane."""
        return [outcome for lane in self._outcomes for outcome in lane]

    def _run_lane(self, targets: list[str], streamed: bool, outcomes: list[Outcome]) -> None:
        with suppress(Stopped):
            for target in targets:
                outcomes.append(self._run_streamed(target) if streamed else self._run_held(target))

    def _run_streamed(self, target: str) -> Outcome:
        """The target's lines are written as they come, each whole (a held target's log never splits one)."""
        self._write(f"== {target}: its output follows as it comes\n")
        started = time.monotonic()
        proc = self._start(target, subprocess.PIPE)
        assert proc.stdout is not None
        for line in proc.stdout:
            self._write(line.decode(errors="replace"))
        return Outcome(target, proc.wait(), time.monotonic() - started)

    def _run_held(self, target: str) -> Outcome:
        log = self.logs / f"{target}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with log.open("wb") as sink:
            returncode = self._start(target, sink).wait()
        outcome = Outcome(target, returncode, time.monotonic() - started)
        head = f"== {target} ({_result(outcome)} in {outcome.seconds:.0f} s): its output\n"
        self._write(head + log.read_text(errors="replace") + f"== end of {target}\n")
        return outcome

    def _start(self, target: str, sink: IO[bytes] | int) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._stopping:
                raise Stopped("stopping")
            # A session of its own: stop() ends the target with everything it started.
            argv = [self.make, "--no-print-directory", target]
            proc = subprocess.Popen(
                argv, cwd=self.directory, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            self._procs.append(proc)
        return proc

    def _write(self, text: str) -> None:
        with self._lock:
            self.out.write(text)
            self.out.flush()

    def stop(self, grace: float = 30) -> None:
        """SIGTERM to every target's process group, SIGKILL to those left after ``grace`` seconds; then
        waits for the lanes to write what their targets wrote (a held target's log, whole)."""
        with self._lock:
            self._stopping = True
            procs = list(self._procs)
        end_groups(procs, grace)
        for thread in self._threads:
            thread.join(timeout=grace)


def _result(outcome: Outcome) -> str:
    return "passed" if outcome.passed else f"FAILED (exit {outcome.returncode})"


def summary(outcomes: list[Outcome], seconds: float, loads: tuple[float, float]) -> str:
    width = max([len(o.target) for o in outcomes], default=0)
    rows = [f"{o.target:<{width}}  {_result(o):<16}  {o.seconds:6.0f} s" for o in outcomes]
    total = (
        f"all lanes: {seconds:.0f} s on {os.cpu_count()} cores; "
        f"1-minute load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end"
    )
    return "\n".join(["== make targets, their results and walls", *rows, total])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraflow.dev.lanes", description=__doc__.split("\n\n")[0])
    parser.add_argument("lanes", nargs="+", help="a lane: make targets separated by spaces, run one after another")
    parser.add_argument("--make", default="make", help="the make to call (the Makefile passes $(MAKE))")
    parser.add_argument("--logs", type=Path, default=Path("build/lanes"), help="where held targets' logs go")
    parser.add_argument("-C", "--directory", type=Path, help="run make there (default: here)")
    parser.add_argument("--one-lane", action="store_true", help="every target in one lane, in the order given")
    args = parser.parse_args(argv)
    try:
        lanes = parse_lanes(args.lanes, args.one_lane)
    except LanesError as e:
        parser.error(str(e))
    runner = Lanes(args.make, args.logs, sys.stdout, args.directory)
    stop, signals = threading.Event(), []

    def request_stop(signum: int, frame: FrameType | None) -> None:  # a second signal changes nothing
        signals.append(signal.Signals(signum).name)
        stop.set()

    previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    started, load = time.monotonic(), os.getloadavg()[0]
    try:
        ended = runner.run(lanes, stop)
        if not ended:
            print(f"stopped ({signals[0]}): ending every target", flush=True)
            runner.stop()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    outcomes = runner.outcomes()
    print(summary(outcomes, time.monotonic() - started, (load, os.getloadavg()[0])), flush=True)
    return 0 if ended and all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
