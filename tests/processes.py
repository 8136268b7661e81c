"""What the tests read of running processes (Linux /proc): alive or not, and who started whom."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent is not). Only for a process this test holds (its child):
    another's pid may be reused once it ends; compare ``identities`` then."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def identities(pids: Iterable[int]) -> set[tuple[int, int]]:
    """Each running process as (pid, start time): that very process, whatever later reuses its pid."""
    found = set()
    for pid in pids:
        try:
            stat = _stat(pid)
        except OSError:
            continue
        if stat[0] != "Z":
            found.add((pid, int(stat[19])))
    return found


def still_running(processes: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which of these processes (``identities``) run still."""
    return processes & identities(pid for pid, _ in processes)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (not those that left the tree: reparented orphans)."""
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found
