"""Keep a training run's Orbax checkpoints outside the machines that train.

One host: Orbax writes step directories ``<local>/<step>/`` (finalised by an atomic rename). After
each one appears we copy it to ``<remote>/<step>/`` and write ``<remote>/<step>/_LORAFLOW_COMPLETE.json``
last (file sizes and crc32c): a step without that marker is an interrupted upload and is ignored.
At start, the newest complete step is downloaded and verified, so a restarted run (on a new host)
resumes from it.

Several hosts (``HostSyncer``): every host's Orbax writes its own shards of a step to its own disk;
each host uploads its part to ``<remote>/<step>/host-<i>/`` with ``_LORAFLOW_HOST.json`` last. At each
poll the hosts tell each other (a collective: ``agree``) the newest step they have uploaded; a step
every host has uploaded is committed once, by host 0, which writes ``<remote>/<step>/_LORAFLOW_COMPLETE.json``
listing every host's files (``host-<i>/<name>``) and the host count. On resume each host downloads
only its own part of the newest committed step; a step some host has not uploaded is never
committed, and an uncommitted step is never restored.

``remote`` is a ``gs://`` prefix (the stage's own ``{output}/_checkpoints``, outside the committed
files) or, for tests of one host, a local directory.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loraflow.errors import ArtifactError
from loraflow.storage import artifacts, faults, gcs, json_objects
from loraflow.storage.local_paths import local_paths

MARKER = "_LORAFLOW_COMPLETE.json"  # a step's commit marker (one host or several)
HOST_MARKER = "_LORAFLOW_HOST.json"  # one host's part of a step is uploaded (several hosts)
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


def host_part(host: int) -> str:
    """The folder of host ``host``'s part of a step, under ``<remote>/<step>/``."""
    return f"host-{host}"


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


def download_latest(remote: str, local: Path, host: int | None = None, hosts: int | None = None) -> int | None:
    """Fetch the newest complete step into ``local/<step>``; verify sizes and checksums. None if none.

    With ``hosts`` (a run of several hosts) only host ``host``'s part of the step is fetched; a step
    written by another number of hosts (or by one) is refused: its shards are laid out for that count.
    """
    steps = remote_steps(remote)
    if not steps:
        return None
    step = steps[-1]
    dest = local / str(step)
    marker_uri = gcs.join(remote, str(step), MARKER) if _is_gcs(remote) else str(Path(remote) / str(step) / MARKER)
    marker = artifacts.read_json(marker_uri) if _is_gcs(remote) else json_objects.read_file_object(Path(marker_uri))
    if marker is None:
        raise ArtifactError(f"checkpoint {step} under {remote} lost its {MARKER} while being restored")
    part, wanted = _restore_part(marker, marker_uri, host, hosts)
    # Every name the marker lists is checked before the local step folder is touched.
    what = f"checkpoint marker {marker_uri}"
    targets = local_paths(dest, wanted, what=what)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if _is_gcs(remote):
        bucket_name, base = gcs.split_uri(gcs.join(remote, str(step)))
        bucket = gcs.client().bucket(bucket_name)
        for name, meta in wanted.items():
            size, crc = artifacts.download_with_crc32c(bucket.blob(f"{base}/{part}{name}"), targets[name])
            if (size, crc) != (meta["size"], meta["crc32c"]):
                raise ArtifactError(f"checkpoint file {part}{name} under {remote} fails its size/checksum check")
    else:
        sources = local_paths(Path(remote) / str(step) / part, wanted, what=what)
        for name, meta in wanted.items():
            targets[name].parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sources[name], targets[name])
            _verify(targets[name], meta, name, remote)
    return step


def _restore_part(
    marker: dict[str, Any], marker_uri: str, host: int | None, hosts: int | None
) -> tuple[str, dict[str, Any]]:
    """(folder under the step, {name: size and checksum}) of what this host restores from a commit marker."""
    written_by = marker.get("hosts")
    if written_by != hosts:
        raise ArtifactError(
            f"checkpoint {marker_uri} was written by {written_by or 1} host(s), each its own shards, but this run "
            f"has {hosts or 1}: run on {written_by or 1}, or remove that _checkpoints prefix to start over"
        )
    if hosts is None:
        return "", marker["files"]
    part = host_part(host or 0) + "/"
    return part, {name[len(part) :]: meta for name, meta in marker["files"].items() if name.startswith(part)}


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


# ------------------------------------------------------------------------------------ several hosts


def upload_host_part(local: Path, remote: str, step: int, host: int, hosts: int) -> dict[str, Any]:
    """Upload this host's ``local/<step>`` to ``<remote>/<step>/host-<host>/``, its ``HOST_MARKER`` last."""
    if not _is_gcs(remote):
        raise ArtifactError(f"checkpoints of several hosts go to a gs:// prefix, not {remote}")
    dest = gcs.join(remote, str(step), host_part(host))
    _delete_prefix(dest)  # a part an earlier attempt left: marker first, never mixed with this one's files
    files = artifacts.upload_tree(local / str(step), dest)
    faults.point("checkpoint_upload")
    artifacts.write_json(gcs.join(dest, HOST_MARKER), {"step": step, "host": host, "hosts": hosts, "files": files})
    return files


def commit_step(remote: str, step: int, hosts: int) -> dict[str, Any]:
    """Write the step's commit marker listing every host's part; refuses while a part is missing."""
    files: dict[str, Any] = {}
    for host in range(hosts):
        uri = gcs.join(remote, str(step), host_part(host), HOST_MARKER)
        part = artifacts.read_json(uri)
        if not isinstance(part, dict) or part.get("step") != step or part.get("hosts") != hosts:
            raise ArtifactError(f"checkpoint step {step} cannot be committed: host {host}'s part has no {uri}")
        files |= {f"{host_part(host)}/{name}": meta for name, meta in part["files"].items()}
    artifacts.write_json(gcs.join(remote, str(step), MARKER), {"step": step, "hosts": hosts, "files": files})
    return files


def _delete_prefix(prefix: str) -> None:
    bucket_name, base = gcs.split_uri(prefix)
    blobs = list(gcs.client().list_blobs(bucket_name, prefix=base + "/"))
    # The marker first: a half-deleted part must never look uploaded.
    for blob in sorted(blobs, key=lambda b: b.name != f"{base}/{HOST_MARKER}"):
        blob.delete()


def _drop_uncommitted(remote: str, below: int) -> None:
    """Delete the parts of steps older than ``below`` that were never committed (superseded)."""
    committed = set(remote_steps(remote))
    bucket_name, base = gcs.split_uri(remote)
    prefix = base.rstrip("/") + "/" if base else ""
    for blob in list(gcs.client().list_blobs(bucket_name, prefix=prefix)):
        step = _step_number(blob.name[len(prefix) :].partition("/")[0])
        if step is not None and step < below and step not in committed:
            blob.delete()


class HostSyncer:
    """One host's side of a checkpoint of several hosts: uploads its part of each newly finalised
    step, then agrees with the others (``agree``: every host's newest uploaded step, a collective
    that every host calls as often) which step all have uploaded; host 0 commits it. Every host
    must call ``poll()`` at the same points (each training step, and once at the end)."""

    def __init__(
        self,
        local: Path,
        remote: str,
        host: int,
        hosts: int,
        agree: Callable[[int], list[int]],
        progress: Callable[[str], None] | None = None,
        keep: int = 2,
    ):
        self.local, self.remote, self.host, self.hosts = local, remote, host, hosts
        self.agree, self.progress, self.keep = agree, progress, keep
        committed = remote_steps(remote)
        self.done: set[int] = set(committed)
        self.committed = committed[-1] if committed else 0

    def poll(self) -> list[int]:
        new = [s for s in finalised_steps(self.local) if s not in self.done]
        for step in new:
            files = upload_host_part(self.local, self.remote, step, self.host, self.hosts)
            self.done.add(step)
            if self.progress:
                self.progress(
                    f"checkpoint step {step}: host {self.host}'s part persisted to "
                    f"{self.remote}/{step}/{host_part(self.host)} ({len(files)} files)"
                )
            faults.point("mid_training")
        # Every host uploads the same steps in the same order: the oldest of the hosts' newest
        # uploaded steps is one that every host has uploaded.
        everyone = self.agree(max(self.done, default=0))
        step = min(everyone)
        if step > self.committed:
            if self.host == 0:
                files = commit_step(self.remote, step, self.hosts)
                if self.progress:
                    self.progress(
                        f"checkpoint step {step} committed: all {self.hosts} hosts uploaded their parts ({len(files)} files)"
                    )
                prune(self.remote, self.keep)
                _drop_uncommitted(self.remote, below=step)
            self.committed = step
        return new
