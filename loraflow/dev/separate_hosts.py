"""Local processes that stand in for separate hosts: each gets a disk of its own, nothing shared but GCS.

On a TPU slice every host has its own HOME, temporary directory, scratch space and working
directory; processes on one machine would otherwise share them all and hide any code that relies on
a shared disk. ``host_dirs`` makes those directories for one "host" under ``root`` and returns the
environment that points a process at them (and the working directory to start it in). The local
stack's Celery workers are such hosts too (``loraflow.dev.demo``).
"""

from __future__ import annotations

from pathlib import Path

# What a process finds its disk through: its home (and the caches under it), temporary files,
# loraflow's scratch directory (the step harness's work and output folders).
HOST_DIRS = {"HOME": "home", "TMPDIR": "tmp", "LORAFLOW_SCRATCH": "scratch", "XDG_CACHE_HOME": "home/.cache"}


def host_dirs(root: Path, name: str) -> tuple[dict[str, str], Path]:
    """(environment, working directory) of host ``name``: directories under ``root/name`` only it uses."""
    base = root / name
    env = {var: str(base / sub) for var, sub in HOST_DIRS.items()}
    work = base / "work"
    for folder in (*map(Path, env.values()), work):
        folder.mkdir(parents=True, exist_ok=True)
    return env, work
