"""The local stack's CeleryExecutor: a Redis broker on 127.0.0.1 and the settings of its workers.

Each worker stands in for a separate machine (``loraflow.dev.separate_hosts``): its own HOME, TMPDIR,
scratch, Airflow home (configuration, pid file, local task logs) and spec cache, and a host name of its
own in the task instances (``worker_hostname``). What the workers share is what the machines of a
production Celery deployment share: the DAG folder (a synced or baked-in copy there), the metadata
database (PostgreSQL), the broker and GCS. Task logs go to GCS (Airflow's remote logging), as on Cloud
Composer, since no worker can read another's disk.

Redis comes from Debian's ``redis-server`` package (``make test-e2e`` installs it when missing);
nothing here imports Airflow, so the demo can read these settings without paying for it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loraflow.dev import local_gcs
from loraflow.errors import LoraflowError

#: The environment variable a worker's host name is read from (``worker_hostname``).
HOSTNAME_ENV = "LORAFLOW_WORKER_HOSTNAME"


def worker_hostname() -> str:
    """Airflow's ``[core] hostname_callable`` on the local stack's workers: the name the stack gave this
    worker, so that each task try records which "machine" ran it; elsewhere the machine's name."""
    return os.environ.get(HOSTNAME_ENV) or socket.getfqdn()


@dataclass(frozen=True)
class CeleryWorkers:
    """What the local stack runs instead of the LocalExecutor: ``count`` Celery workers of ``concurrency``
    task slots each, and how soon a task whose worker vanished is retried (``heartbeat_timeout`` seconds
    without a heartbeat: Airflow's ``[scheduler] task_instance_heartbeat_timeout``, 300 by default)."""

    count: int = 2
    concurrency: int = 2
    heartbeat_timeout: int = 45

    def __post_init__(self) -> None:
        if self.count < 1 or self.concurrency < 1:
            raise LoraflowError(f"CeleryWorkers needs at least one worker of one slot, got {self}")
        if self.heartbeat_timeout < 10:
            raise LoraflowError(
                f"heartbeat_timeout {self.heartbeat_timeout} s would fail healthy tasks on a loaded machine: "
                "use 10 s or more"
            )

    def names(self) -> list[str]:
        return [f"celery-worker-{i + 1}" for i in range(self.count)]


def redis_server() -> Path:
    """The redis-server binary (Debian's package)."""
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else "")
    if not found:
        raise LoraflowError(
            "redis-server is not installed: the CeleryExecutor's broker is Redis; `make test-e2e` installs "
            "Debian's redis-server package (or: apt-get install redis-server)"
        )
    return Path(found)


@dataclass
class Broker:
    url: str
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """End the server this module started, by its process id."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _answered(broker: Broker, port: int, folder: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker.process.poll() is not None:
            status = broker.process.returncode
            raise LoraflowError(f"redis-server exited at start (status {status}); see {folder}/redis.log")
        if _pong(port):
            return True
        time.sleep(0.2)
    return False


def start_broker(
    folder: Path, port: int | None = None, timeout: float = 30, env: Mapping[str, str] | None = None
) -> Broker:
    """Redis on 127.0.0.1, in memory only (nothing saved to ``folder`` but its log), in environment ``env``
    (default: this process's); returns once it answers."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or local_gcs.free_port()
    argv = [str(redis_server()), "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(folder), "--logfile", str(folder / "redis.log")]
    process = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env
    )
    broker = Broker(f"redis://127.0.0.1:{port}/0", process)
    try:
        if _answered(broker, port, folder, timeout):
            return broker
    except BaseException:  # a signal (Ctrl-C, SIGTERM), or it exited
        broker.stop()  # never leave a server behind that nobody holds
        raise
    broker.stop()
    raise LoraflowError(f"redis-server did not answer on 127.0.0.1:{port} within {timeout:.0f} s")
