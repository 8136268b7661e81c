"""One local stack per home, stopped by any signal, nothing of it left behind (``demo.local_stack``).

What proves a process belongs to the stack on a home (``belonging``): its environment carries
``LORAFLOW_DEMO_STACK=<the home>`` (every process the stack starts does, and what those fork or start
with their environment); or the stack recorded starting it, by process id and start time, in
``<home>/stack.pid`` (a process that renames itself, setproctitle, loses the marker from /proc); or it is
in the session of such a recorded process while that one lives; or it descends from any of those.
The stack's main process holds an exclusive lock on ``stack.pid`` (its own id on the first line) while it
runs; the kernel drops the lock however that process ends, SIGKILL included. Linux: read from /proc.

- SIGTERM and SIGHUP stop the stack as Ctrl-C does: each raises ``StopSignal`` (a KeyboardInterrupt) in
  the main thread; from then on, and while the stack stops, further signals are ignored, so a second
  Ctrl-C or SIGTERM cannot cut the stop short.
- At start, a home whose lock is held is refused (a stack runs there). Processes of the home's stack
  while nobody holds the lock are what an earlier stack left (its main process was killed with SIGKILL,
  or crashed): they are ended first, and said so.
- At the end, whatever of the stack is still alive (a task process in a process group of its own) is ended.
- Waiting on a run: a task queued with no progress of its run for ``QUEUED_BOUND`` seconds means its
  executor never took it (``stuck_queued_task``).
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from loraflow.errors import LoraflowError

MARKER = "LORAFLOW_DEMO_STACK"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds a task may stay queued, no task of its run changing state meanwhile, before the wait ends.
#: A queued task is one the executor has a free slot for: it starts within seconds when all is well.
QUEUED_BOUND = 300.0
#: What a dag run an earlier stack left unfinished may be in.
UNFINISHED_RUN_STATES = ("queued", "running")


def say(message: str) -> None:
    with suppress(OSError):  # the terminal may be gone (SIGHUP): the stop goes on regardless
        print(f"[loraflow] {message}", flush=True)


def marker_env(home: Path) -> dict[str, str]:
    """The environment variable every process of the stack on ``home`` is started with."""
    return {MARKER: str(home.resolve())}


def carries_marker(environ: bytes, home: Path) -> bool:
    """Whether a process environment (``/proc/PID/environ``: NUL-separated) names ``home``'s stack."""
    entry = f"{MARKER}={home.resolve()}".encode()
    return entry in environ.split(b"\0")


# ---------------------------------------------------------------------------------- processes


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or another user's
        return None


@dataclass(frozen=True)
class Proc:
    """What /proc says of a live process."""

    pid: int
    ppid: int
    sid: int  # its session
    started: int  # clock ticks after boot: with the pid, this very process (a pid is reused, the pair never)
    marked: bool  # its environment names the stack (a renamed process, setproctitle, may have lost it)


def _stat(pid: int) -> list[bytes] | None:
    """/proc/PID/stat after "(comm)": state ppid pgrp session ... starttime (the 20th); None once it ended
    (a zombie waits for its parent to read its status: ended too)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rsplit(b")", 1)[1].split() if stat else None
    return fields if fields and fields[0] != b"Z" else None


def _proc(pid: int, home: Path) -> Proc | None:
    fields = _stat(pid)
    if fields is None:
        return None
    return Proc(
        pid, int(fields[1]), int(fields[3]), int(fields[19]), carries_marker(_read(f"/proc/{pid}/environ") or b"", home)
    )


def _processes(home: Path) -> dict[int, Proc]:
    found = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (proc := _proc(int(entry.name), home)) is not None:
            found[proc.pid] = proc
    return found


def belonging(procs: Mapping[int, Proc], recorded: set[tuple[int, int]], keep: int) -> set[int]:
    """Which of ``procs`` are the stack's: those whose environment names it; those it recorded starting
    (``recorded``: pid and start time); the members of a session such a recorded process leads while it
    lives (the session's id is then that process's alone); every descendant of those. Never ``keep``
    (this process) nor its ancestors."""
    ours = {p.pid for p in procs.values() if p.marked or (p.pid, p.started) in recorded}
    leaders = {pid for pid in ours if (pid, procs[pid].started) in recorded}
    ours |= {p.pid for p in procs.values() if p.sid in leaders}
    while more := {p.pid for p in procs.values() if p.ppid in ours} - ours:
        ours |= more
    pid = keep
    while pid in procs and pid > 1:
        ours.discard(pid)
        pid = procs[pid].ppid
    return ours


def _command(pid: int) -> str:
    """Its command line, shortened (the name in brackets when it has none left: a process ending)."""
    argv = (_read(f"/proc/{pid}/cmdline") or b"").split(b"\0")
    words = [os.path.basename(argv[0].decode(errors="replace")), *(a.decode(errors="replace") for a in argv[1:3])]
    name = (_read(f"/proc/{pid}/comm") or b"?").decode(errors="replace").strip()
    return " ".join(w for w in words if w)[:80] or f"[{name}]"


def _stack(home: Path) -> dict[tuple[int, int], str]:
    """Every live process of the stack on ``home`` (``belonging``): (pid, start time) -> command."""
    if not Path("/proc/self/stat").exists():
        return {}
    procs = _processes(home)
    _, recorded = read_record(home)
    return {(pid, procs[pid].started): _command(pid) for pid in belonging(procs, recorded, os.getpid())}


def stack_processes(home: Path) -> dict[int, str]:
    """Every live process of the stack on ``home`` (``belonging``): pid -> command."""
    return {pid: command for (pid, _), command in sorted(_stack(home).items())}


def _running(processes: Mapping[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """Which of these processes (by pid and start time) still run."""
    return {
        (pid, started): command
        for (pid, started), command in processes.items()
        if (fields := _stat(pid)) is not None and int(fields[19]) == started
    }


def _signal(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process, and to its process group when it leads one (a group it created:
    every member is the stack's)."""
    with suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def _wait_gone(home: Path, seen: dict[tuple[int, int], str], seconds: float) -> dict[tuple[int, int], str]:
    """What still runs of the stack, and of ``seen`` (what was proven the stack's: once its parent or
    session leader has ended, an orphan may lose every proof), once none does or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        seen |= _stack(home)  # a process started meanwhile (a worker replaced) is in it too
        left = _running(seen)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def end_stack_processes(home: Path, grace: float = 10.0, seen: Mapping[tuple[int, int], str] = {}) -> dict[int, str]:
    """End every process of the stack on ``home``, and those of ``seen`` (proven the stack's earlier, by
    pid and start time) that still run: SIGTERM (to its group when it leads one), SIGKILL to what is left
    after ``grace`` seconds. Returns what it ended; raises if any survives."""
    tracked = {**seen, **_stack(home)}
    known = set(tracked)
    left = found = _running(tracked)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid, _ in left:
            _signal(pid, sig)
        left = _wait_gone(home, tracked, wait)
        if not left:
            ended = {**found, **{k: v for k, v in tracked.items() if k not in known}}
            return {pid: command for (pid, _), command in sorted(ended.items())}
    raise LoraflowError(
        f"processes of the local stack on {home} survived SIGKILL "
        f"({describe({pid: command for (pid, _), command in left.items()})}): stop them "
        "(another user's? `ps -o user= -p PID`), then run `make clean`"
    )


def describe(processes: Mapping[int, str]) -> str:
    return ", ".join(f"{pid} {command}" for pid, command in sorted(processes.items()))


# ---------------------------------------------------------------------------------- signals


class StopSignal(KeyboardInterrupt):
    """SIGTERM, SIGHUP (or SIGINT) received: the stack stops as on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class _StopHandler:
    """The stack's handler of STOP_SIGNALS: the first raises StopSignal (at the end of an
    ``uninterrupted()`` block it arrives in), later ones (and any once the stop began: ``shield``) are
    ignored."""

    def __init__(self) -> None:
        self.stopping = False
        self.held = 0  # uninterrupted() blocks open
        self.pending: int | None = None  # the signal to raise as the last of them ends

    def shield(self) -> None:
        self.stopping = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:
            say(
                f"{signal.Signals(signum).name} ignored: the local stack is stopping (`kill -9 {os.getpid()}` abandons it)"
            )
            return
        self.stopping = True
        if self.held:
            self.pending = signum
            return
        raise StopSignal(signum)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """A stop signal that arrives in the body stops the stack at its end, not inside it (between
    starting a process and recording it, say)."""
    handler = signal.getsignal(signal.SIGTERM)
    if not isinstance(handler, _StopHandler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    handler.held += 1
    try:
        yield
    finally:
        handler.held -= 1
        if not handler.held and handler.pending is not None:
            signum, handler.pending = handler.pending, None
            raise StopSignal(signum)


@contextmanager
def _signals_stop() -> Iterator[Callable[[], None]]:
    """While the body runs, STOP_SIGNALS raise StopSignal; yields ``shield``, to call as the stop begins."""
    if threading.current_thread() is not threading.main_thread():  # handlers live in the main thread only
        yield lambda: None
        return
    handler = _StopHandler()
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield handler.shield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ---------------------------------------------------------------------------------- the home's record


def _record_path(home: Path) -> Path:
    return home / "stack.pid"


def parse_record(text: str) -> tuple[int | None, set[tuple[int, int]]]:
    """``stack.pid``: the stack's main process id on the first line, then "PID START_TIME" of each
    process it started. Empty: no stack, or the last one stopped cleanly. Unreadable lines are skipped."""
    lines = [line.split() for line in text.splitlines()]
    if not lines or len(lines[0]) != 1 or not lines[0][0].isdigit():
        return None, _started(lines)
    return int(lines[0][0]), _started(lines[1:])


def _started(lines: list[list[str]]) -> set[tuple[int, int]]:
    return {(int(w[0]), int(w[1])) for w in lines if len(w) == 2 and all(x.isdigit() for x in w)}


def read_record(home: Path) -> tuple[int | None, set[tuple[int, int]]]:
    return parse_record((_read(str(_record_path(home))) or b"").decode(errors="replace"))


def record(env: Mapping[str, str], pid: int) -> None:
    """Note in its stack's record that the stack started process ``pid`` (``env``: the environment it was
    started with; nothing is noted without the stack's marker). Call it in ``uninterrupted()`` with the start."""
    if MARKER in env and (proc := _proc(pid, Path(env[MARKER]))) is not None:
        with open(_record_path(Path(env[MARKER])), "a", encoding="utf-8") as f:
            f.write(f"{pid} {proc.started}\n")


def _lock(home: Path) -> tuple[TextIO, int | None]:
    """Hold ``home``'s record locked; returns it and the main process id an earlier stack left in it
    (None: it stopped cleanly). Refuses while a stack runs there."""
    home.mkdir(parents=True, exist_ok=True)
    f = open(_record_path(home), "a+", encoding="utf-8")  # held while the stack runs
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = parse_record(f.read())[0] or "?"
        f.close()
        raise LoraflowError(
            f"a local stack is running on {home} already (pid {holder}): use it, or stop it first "
            f"(Ctrl-C in its terminal, or `kill {holder}`)"
        ) from None
    f.seek(0)
    return f, parse_record(f.read())[0]


def _begin(f: TextIO) -> None:
    """Start this stack's record (once the earlier stack's leftovers are ended)."""
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()


def _unlock(f: TextIO) -> None:
    f.seek(0)
    f.truncate()  # empty: this stack stopped cleanly
    f.close()


_OWNED: dict[Path, Callable[[], None]] = {}  # the homes this process owns a stack on: their shield


def _clear_leftovers(home: Path, earlier: int | None, grace: float) -> None:
    left = end_stack_processes(home, grace)
    if left:
        say(f"an earlier stack on {home} did not stop (pid {earlier or '?'}); ended what it left: {describe(left)}")
    elif earlier is not None:
        say(f"an earlier stack on {home} (pid {earlier}) did not stop cleanly; none of its processes was left")


@contextmanager
def owned(home: Path, grace: float = 10.0) -> Iterator[Callable[[], None]]:
    """Own the stack on ``home`` for the body: its lock, the signals, what an earlier stack left ended
    first, what is left of the stack ended last. Yields ``stop_begins``: call it as the stack's stop
    begins (signals are ignored from then on, and what runs of the stack is noted: a task process whose
    scheduler is stopped can no longer be told from /proc, yet is ended last). ``grace``: seconds between
    SIGTERM and SIGKILL. Nested in the same process (the Celery demo owns the home around its PostgreSQL
    and the stack), the inner one only yields the outer one's ``stop_begins``."""
    key = home.resolve()
    if key in _OWNED:
        yield _OWNED[key]
        return
    lock, earlier = _lock(home)
    try:
        with _signals_stop() as shield:
            seen: dict[tuple[int, int], str] = {}

            def stop_begins() -> None:
                shield()
                seen.update(_stack(home))

            _OWNED[key] = stop_begins
            try:
                _clear_leftovers(home, earlier, grace)
                _begin(lock)
                yield stop_begins
            finally:
                stop_begins()
                del _OWNED[key]
                left = end_stack_processes(home, grace, seen)
                if left:
                    say(f"ended what was left of the stack: {describe(left)}")
    finally:
        _unlock(lock)


# ---------------------------------------------------------------------------------- runs


def _when(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def leftover_runs(runs: Iterable[Mapping[str, Any]], started_at: datetime) -> list[Mapping[str, Any]]:
    """The dag runs an earlier stack left unfinished: queued or running, and queued (or started) before
    this stack started at ``started_at`` (timezone-aware). A run whose times are unreadable is not one."""
    left = []
    for run in runs:
        since = _when(run.get("queued_at")) or _when(run.get("start_date"))
        if run.get("state") in UNFINISHED_RUN_STATES and since is not None and since < started_at:
            left.append(run)
    return left


def stuck_queued_task(states: Mapping[str, str | None], quiet_for: float, bound: float = QUEUED_BOUND) -> str | None:
    """The task of a run that waits in its executor's queue while no task of the run has changed state
    for ``quiet_for`` seconds, once that reaches ``bound``; None while the run moves."""
    if quiet_for < bound:
        return None
    return next((task for task, state in states.items() if state == "queued"), None)
