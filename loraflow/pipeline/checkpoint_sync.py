"""Keep a training run's Orbax checkpoints outside the machine that trains.

Orbax writes step directories ``<local>/<step>/`` (finalised by an atomic rename). After each one
appears we copy it to ``<remote>/<step>/`` and write ``<remote>/<step>/_LORAFLOW_COMPLETE.json``
last (file sizes and crc32c): a step without that marker is an interrupted upload and is ignored.
At start, the newest complete step is downloaded and verified, so a restarted run (on a new host)
resumes from it.

``remote`` is a ``gs://`` prefix (the stage's own ``{output}/_checkpoints``, outside the committed
files) or, for tests, a local directory.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow.errors import ArtifactError
from loraflow.pipeline import artifacts, faults, gcs
from loraflow.pipeline.local_paths import local_paths

MARKER = "_LORAFLOW_COMPLETE.json"
_STEP = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes '²', which int() refuses


def _step_number(name: str) -> int | None:
    return int(name) if _STEP.fullmatch(name) else None


def _is_gcs(remote: str) -> bool:
    return remote.startswith("gs://")


def finalised_steps(local: Path) -> list[int]:
    """Step directories Orbax has finalised (integer names; temporary dirs carry a suffix)."""
    if not local.is_dir():
        return []
    return sorted(n for p in local.iterdir() if p.is_dir() and (n := _step_number(p.name)) is not None)


def remote_steps(remote: str) -> list[int]:
    """Steps whose upload completed (marker present), ascending."""
    steps: set[int] = set()
    if _is_gcs(remote):
        bucket_name, base = gcs.split_uri(remote)
        prefix = base.rstrip("/") + "/" if base else ""
        for blob in gcs.client().list_blobs(bucket_name, prefix=prefix):
            rest = blob.name[len(prefix) :]
            step, _, name = rest.partition("/")
            number = _step_number(step)
            if name == MARKER and number is not None:
                steps.add(number)
    else:
        root = Path(remote)
        if root.is_dir():
            steps = {n for p in root.glob(f"*/{MARKER}") if (n := _step_number(p.parent.name)) is not None}
    return sorted(steps)


def upload_step(local: Path, remote: str, step: int) -> dict[str, Any]:
    src = local / str(step)
    files: dict[str, dict[str, Any]] = {}
    if _is_gcs(remote):
        files = artifacts.upload_tree(src, gcs.join(remote, str(step)))
        faults.point("checkpoint_upload")
        artifacts.write_json(gcs.join(remote, str(step), MARKER), {"step": step, "files": files})
    else:
        dest = Path(remote) / str(step)
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src, dest)
        for p in sorted(q for q in src.rglob("*") if q.is_file()):
            files[p.relative_to(src).as_posix()] = {"size": p.stat().st_size, "crc32c": artifacts.crc32c_file(p)}
        (dest / MARKER).write_text(json.dumps({"step": step, "files": files}))
    return files


def download_latest(remote: str, local: Path) -> int | None:
    """Fetch the newest complete step into ``local/<step>``; verify sizes and checksums. None if none."""
    steps = remote_steps(remote)
    if not steps:
        return None
    step = steps[-1]
    dest = local / str(step)
    marker_uri = gcs.join(remote, str(step), MARKER) if _is_gcs(remote) else str(Path(remote) / str(step) / MARKER)
    marker = artifacts.read_json(marker_uri) if _is_gcs(remote) else json.loads(Path(marker_uri).read_text())
    if marker is None:
        raise ArtifactError(f"checkpoint {step} under {remote} lost its {MARKER} while being restored")
    # Every name the marker lists is checked before the local step folder is touched.
    what = f"checkpoint marker {marker_uri}"
    targets = local_paths(dest, marker["files"], what=what)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if _is_gcs(remote):
        bucket_name, base = gcs.split_uri(gcs.join(remote, str(step)))
        bucket = gcs.client().bucket(bucket_name)
        for name, meta in marker["files"].items():
            size, crc = artifacts.download_with_crc32c(bucket.blob(f"{base}/{name}"), targets[name])
            if (size, crc) != (meta["size"], meta["crc32c"]):
                raise ArtifactError(f"checkpoint file {name} under {remote} fails its size/checksum check")
    else:
        sources = local_paths(Path(remote) / str(step), marker["files"], what=what)
        for name, meta in marker["files"].items():
            targets[name].parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sources[name], targets[name])
            _verify(targets[name], meta, name, remote)
    return step


def _verify(path: Path, meta: dict[str, Any], name: str, remote: str) -> None:
    if path.stat().st_size != meta["size"] or artifacts.crc32c_file(path) != meta["crc32c"]:
        raise ArtifactError(f"checkpoint file {name} under {remote} fails its size/checksum check")


def prune(remote: str, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` complete remote steps (and nothing else)."""
    old = remote_steps(remote)[:-keep] if keep > 0 else []
    for step in old:
        if _is_gcs(remote):
            bucket_name, base = gcs.split_uri(gcs.join(remote, str(step)))
            # Marker first: a half-deleted step must never look complete.
            gcs.client().bucket(bucket_name).blob(f"{base}/{MARKER}").delete()
            for blob in list(gcs.client().list_blobs(bucket_name, prefix=base + "/")):
                blob.delete()
        else:
            d = Path(remote) / str(step)
            (d / MARKER).unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)


class Syncer:
    """Uploads each newly finalised local step once; call ``poll()`` often (cheap) and at the end."""

    def __init__(self, local: Path, remote: str, progress: Callable[[str], None] | None = None, keep: int = 2):
        self.local, self.remote, self.progress, self.keep = local, remote, progress, keep
        self.done: set[int] = set(remote_steps(remote))

    def poll(self) -> list[int]:
        new = [s for s in finalised_steps(self.local) if s not in self.done]
        for step in new:
            files = upload_step(self.local, self.remote, step)
            self.done.add(step)
            if self.progress:
                self.progress(f"checkpoint step {step} persisted to {self.remote}/{step} ({len(files)} files)")
            faults.point("mid_training")
        if new:
            prune(self.remote, self.keep)
        return new
