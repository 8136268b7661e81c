"""A throwaway PostgreSQL on 127.0.0.1 for the local stack's metadata database (the load and Celery
end-to-end tests): a fresh cluster in a temp dir, installed from Debian's packages when the machine
lacks one (CI runs as root), stopped and deleted on exit. Trust authentication, fsync off: for tests only.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from loraflow.dev import local_gcs
from loraflow.errors import LoraflowError


def say(message: str) -> None:
    print(f"[loraflow] {message}", flush=True)


def installed_initdb() -> list[str]:
    """Every installed PostgreSQL's initdb, oldest major version first (by number: 9.6 before 15)."""
    found = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    return sorted(found, key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()])


def postgres_bin() -> Path:
    """PostgreSQL's server binaries; installed from the Debian packages when absent."""
    found = installed_initdb()
    if not found:
        say("PostgreSQL is not installed: apt-get install -y postgresql")
        subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"],
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        found = installed_initdb()
    return Path(found[-1]).parent


def as_postgres(argv: list[str]) -> list[str]:
    """initdb and the server refuse to run as root: run them as the ``postgres`` system user."""
    return argv if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--", *argv]


@contextmanager
def running(max_connections: int = 200, env: Mapping[str, str] = {}) -> Iterator[str]:
    """A PostgreSQL cluster on 127.0.0.1 (data and socket in a temp dir), its server started with ``env``
    added to its environment; yields its SQLAlchemy URL."""
    if importlib.util.find_spec("asyncpg") is None:
        raise LoraflowError(
            "the control environment lacks asyncpg, the async PostgreSQL driver Airflow 3 opens beside "
            "psycopg2 for a postgresql:// metadata DB; add asyncpg to envs/control.in and re-lock"
        )
    bin_dir = postgres_bin()
    # Outside pytest's tmp dir: that one is readable by root only, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="loraflow-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = local_gcs.free_port()
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run(
            as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-U", "airflow", "--auth=trust", "-E", "UTF8"]),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        options = f"-h 127.0.0.1 -p {port} -k {sock} -c max_connections={max_connections} -c fsync=off"
        subprocess.run(
            as_postgres([*pg_ctl, "-l", str(root / "server.log"), "-o", options, "-w", "start"]),
            check=True,
            stdout=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        subprocess.run(
            as_postgres([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "airflow", "airflow"]),
            check=True,
        )
        say(f"PostgreSQL {bin_dir.parent.name} on 127.0.0.1:{port} (data {data})")
        yield f"postgresql+psycopg2://airflow@127.0.0.1:{port}/airflow"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(as_postgres([*pg_ctl, "-m", "fast", "-w", "stop"]), stdout=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)
