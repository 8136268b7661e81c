"""Start and stop the GCS emulator (gcp-storage-emulator) on 127.0.0.1 for the demo and the tests.

The emulator plays GCS only locally; every loraflow read and write still goes through the
google-cloud-storage client with gs:// URIs, as in production.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from loraflow.errors import LoraflowError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Emulator:
    host: str
    bucket: str
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.host, "GOOGLE_CLOUD_PROJECT": "loraflow-local"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _executable() -> str:
    """The emulator lives in the control environment; tests of other environments borrow it."""
    from loraflow.environments import REPO_ROOT

    for candidate in (
        Path(sys.executable).parent / "gcp-storage-emulator",
        REPO_ROOT / ".venvs" / "control" / "bin" / "gcp-storage-emulator",
    ):
        if candidate.exists():
            return str(candidate)
    found = shutil.which("gcp-storage-emulator")
    if not found:
        raise LoraflowError("gcp-storage-emulator is not installed; run `make envs`")
    return found


def start(bucket: str, data_dir: Path | None = None, port: int | None = None, log: Path | None = None) -> Emulator:
    """Start an emulator holding ``bucket``; on disk under ``data_dir`` or in memory."""
    exe = _executable()
    port = port or free_port()
    argv = [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket", bucket]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if data_dir is None:
        argv.append("--in-memory")
    else:
        data_dir.mkdir(parents=True, exist_ok=True)
        env |= {"STORAGE_BASE": str(data_dir.resolve()), "STORAGE_DIR": "gcs"}
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    host = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LoraflowError(f"the GCS emulator exited at start (status {proc.returncode}); see {log}")
        try:
            urllib.request.urlopen(f"{host}/storage/v1/b", timeout=1)
            return Emulator(host, bucket, proc)
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise LoraflowError(f"the GCS emulator did not answer on {host} within 30 s")
