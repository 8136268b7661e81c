"""The GCS hand-off contract between stages.

A stage writes its files under its own prefix, ``{artifact_root}/{pipeline}/{run_id}/{stage}/``,
then commits them by writing ``_MANIFEST.json`` last. The manifest lists every file with its size
and crc32c (base64, as GCS reports it), the fingerprints of the stage's inputs, its resolved config
and the lock version of the environment that produced it. Readers refuse a prefix without a
manifest, refuse a manifest that was copied from another prefix, and verify the checksum of every
file they read.

Cache: ``{artifact_root}/_cache/{stage}/{cache_key}.json`` points at a committed manifest. The key
hashes the input fingerprints, the resolved stage config and the lock version, so a hit means the
stage would compute exactly what is already there.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from loraflow.errors import ArtifactError
from loraflow.storage import faults, gcs, json_objects
from loraflow.storage.json_objects import JsonObjectError as JsonObjectError
from loraflow.storage.json_objects import read_json_object as read_json_object
from loraflow.storage.local_paths import check_name, local_paths, name_problem

log = logging.getLogger(__name__)

MANIFEST = "_MANIFEST.json"
MANIFEST_FORMAT = "loraflow.manifest/1"
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_run_id(run_id: str) -> str:
    """Airflow run ids hold ``:`` and ``+``; keep object names plain and portable."""
    cleaned = _RUN_ID_UNSAFE.sub("-", run_id).strip("-.")
    if not cleaned:
        raise ArtifactError(f"run id {run_id!r} has no usable characters")
    return cleaned


def stage_prefix(artifact_root: str, pipeline: str, run_id: str, stage: str) -> str:
    return gcs.join(artifact_root, pipeline, safe_run_id(run_id), stage)


def crc32c_file(path: Path) -> str:
    import google_crc32c

    checksum = google_crc32c.Checksum()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 << 20), b""):
            checksum.update(block)
    return base64.b64encode(checksum.digest()).decode()


def fingerprint(files: Mapping[str, Mapping[str, Any]]) -> str:
    """Content fingerprint of a set of files: their names, sizes and checksums."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]['size']}\0{files[name]['crc32c']}\n".encode())
    return h.hexdigest()


def input_identity(manifest: Manifest) -> str:
    """What stands for an upstream stage in a downstream stage's cache key: the upstream's own cache
    key (what it was computed from), or, for a manifest without one, its files' fingerprint."""
    return str(manifest.data.get("cache_key") or manifest.fingerprint)


def cache_key(input_fingerprints: Mapping[str, str], config: Mapping[str, Any], lock_version: str) -> str:
    payload = json.dumps(
        {"inputs": dict(sorted(input_fingerprints.items())), "config": config, "lock": lock_version},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def lock_version(lock_file: Path) -> str:
    return hashlib.sha256(lock_file.read_bytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Manifest:
    uri: str
    data: dict[str, Any]

    @property
    def prefix(self) -> str:
        return self.uri.rsplit("/", 1)[0]

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.data["files"]
        return files

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.files)

    @property
    def summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = self.data.get("summary", {})
        return summary


# --------------------------------------------------------------------------------------- writing


def upload_tree(
    local_dir: Path, prefix: str, progress: Callable[[str], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Upload every file under ``local_dir`` to ``prefix``; return the manifest's file table."""
    from google.api_core.exceptions import BadRequest, Conflict

    bucket_name, base = gcs.split_uri(prefix)
    bucket = gcs.client().bucket(bucket_name)
    files: dict[str, dict[str, Any]] = {}
    # A name readers would refuse (local_paths) is never uploaded: all are checked before the first is.
    paths = {
        check_name(
            p.relative_to(local_dir).as_posix(),
            what=f"the step's output folder {local_dir}",
            fix=f"Nothing was uploaded to {prefix}; rename that file in the step",
        ): p
        for p in sorted(q for q in local_dir.rglob("*") if q.is_file())
    }
    if MANIFEST in paths:
        raise ArtifactError(f"a step may not write {MANIFEST} itself ({paths[MANIFEST]})")
    for rel, path in paths.items():
        crc = crc32c_file(path)
        blob = bucket.blob(f"{base}/{rel}" if base else rel)
        # The checksum travels with the upload and GCS refuses bytes that do not match it; the
        # client need not compute it a second time while sending (checksum=None).
        blob.crc32c = crc
        try:
            blob.upload_from_filename(str(path), checksum=None)
        except (BadRequest, Conflict) as exc:
            raise ArtifactError(f"upload of {rel} to {prefix} was refused as corrupted ({exc})") from None
        if blob.crc32c and blob.crc32c != crc:
            raise ArtifactError(f"upload of {rel} to {prefix} was corrupted: crc32c {blob.crc32c} != {crc}")
        files[rel] = {"size": path.stat().st_size, "crc32c": crc}
        faults.point("mid_upload")
        if progress:
            progress(f"uploaded {rel} ({files[rel]['size']} bytes)")
    return files


def commit(
    prefix: str,
    files: dict[str, dict[str, Any]],
    *,
    stage: str,
    inputs: Mapping[str, Mapping[str, str]],
    config: Mapping[str, Any],
    lock_version: str,
    cache_key: str,
    summary: Mapping[str, Any],
) -> Manifest:
    """Write ``_MANIFEST.json`` last, create-only: from this moment the prefix is an artifact, and no
    other writer (a retry racing a step that outlived its task) can replace it."""
    uri = gcs.join(prefix, MANIFEST)
    data = {
        "format": MANIFEST_FORMAT,
        "stage": stage,
        "prefix": prefix.rstrip("/"),
        "files": files,
        "inputs": dict(inputs),
        "config": dict(config),
        "lock_version": lock_version,
        "cache_key": cache_key,
        "summary": dict(summary),
        "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    from google.api_core.exceptions import PreconditionFailed

    try:
        write_json(uri, data, create_only=True)  # GCS decides: of two writers of one prefix, one commits
    except PreconditionFailed:
        raise ArtifactError(
            f"{uri} was committed by another writer first (a second attempt of {stage} on the same prefix); "
            "committed artifacts are never overwritten: this attempt's files are not an artifact; "
            "the task's next try reuses that commit (same cache key) or commits beside it"
        ) from None
    return Manifest(uri, data)


def write_json(uri: str, data: Any, *, create_only: bool = False) -> None:
    """Write ``data`` as JSON; with ``create_only`` only if no object of that name exists (else GCS
    answers 412: ``PreconditionFailed``)."""
    bucket, path = gcs.split_uri(uri)
    blob = gcs.client().bucket(bucket).blob(path)
    blob.upload_from_string(
        json.dumps(data, indent=2, sort_keys=True),
        content_type="application/json",
        if_generation_match=0 if create_only else None,
    )


def read_json(uri: str) -> dict[str, Any] | None:
    """The JSON object at ``uri`` (a manifest, a marker, a report), or None when there is none; read as every
    JSON object from GCS is (``json_objects``: size-, depth- and type-checked), up to a document's cap."""
    return read_json_object(uri, max_bytes=json_objects.DOCUMENT_MAX_BYTES)


# --------------------------------------------------------------------------------------- reading


def manifest_uri(prefix_or_manifest: str) -> str:
    if prefix_or_manifest.endswith("/" + MANIFEST):
        return prefix_or_manifest
    return gcs.join(prefix_or_manifest, MANIFEST)


def read_manifest(uri: str) -> Manifest:
    """Load a committed manifest; refuse a missing one and one copied from another prefix."""
    uri = manifest_uri(uri)
    data = read_json(uri)
    if data is None:
        raise ArtifactError(
            f"no committed artifact at {uri.rsplit('/', 1)[0]}: {MANIFEST} is missing "
            "(the stage never finished, or the prefix is wrong); re-run the stage that writes it"
        )
    if data.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{uri} is not a loraflow manifest (format {data.get('format')!r})")
    manifest = Manifest(uri, data)
    if data.get("prefix") != manifest.prefix:
        raise ArtifactError(
            f"{uri} was written for {data.get('prefix')!r}, not for {manifest.prefix!r}: "
            "a manifest copied from another run is never trusted; re-run the stage"
        )
    problem = _file_table_problem(data.get("files"))
    if problem:
        raise ArtifactError(f"{uri} is refused: {problem}; no loraflow step writes that, so re-run the stage")
    return manifest


def _file_table_problem(files: Any) -> str | None:
    """Why a manifest's ``files`` is not a table of safe names with a size and a checksum each."""
    if not isinstance(files, dict):
        return "its 'files' is not a table of file names"
    for name, meta in files.items():
        problem = name_problem(name)
        if problem:
            return f"it lists the file name {name!r}, which may not become a local file ({problem})"
        if not isinstance(meta, dict) or not _is_size(meta.get("size")) or not isinstance(meta.get("crc32c"), str):
            return f"file {name!r} has no size and crc32c ({meta!r})"
    return None


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Crc32cSink:
    """A file being written that checksums what goes through it (the download is read only once)."""

    def __init__(self, fh: BinaryIO) -> None:
        import google_crc32c

        self._new = google_crc32c.Checksum
        self._fh = fh
        self.checksum = self._new()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.checksum.update(data)
        self.size += len(data)
        return self._fh.write(data)

    def seek(self, offset: int, whence: int = 0) -> int:  # the client restarts a transcoded download at 0
        if (offset, whence) != (0, 0):
            raise OSError("a checksummed download can only restart from the beginning")
        self.checksum, self.size = self._new(), 0
        self._fh.truncate(0)
        return self._fh.seek(0)

    def tell(self) -> int:
        return self._fh.tell()

    def flush(self) -> None:
        self._fh.flush()


def download_with_crc32c(blob: Any, dest: Path) -> tuple[int, str]:
    """Download ``blob`` to ``dest``, checksumming while writing: ``(size, crc32c)`` of what was written.

    The caller compares them with what it expects (a manifest); a partial file is removed on error.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(dest, "wb") as fh:
            sink = _Crc32cSink(fh)
            blob.download_to_file(sink, checksum=None)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return sink.size, base64.b64encode(sink.checksum.digest()).decode()


def _download_verified(bucket: Any, object_name: str, dest: Path, name: str, size: int, crc: str, where: str) -> None:
    from google.api_core.exceptions import NotFound

    try:
        actual_size, actual = download_with_crc32c(bucket.blob(object_name), dest)
    except NotFound:
        raise ArtifactError(f"{where}: file {name!r} is listed in the manifest but missing from GCS") from None
    if actual_size != size:
        raise ArtifactError(f"{where}: file {name!r} has {actual_size} bytes, the manifest says {size}")
    if actual != crc:
        raise ArtifactError(f"{where}: file {name!r} fails its checksum (crc32c {actual}, manifest {crc})")


def fetch(manifest: Manifest, dest: Path, only: Iterable[str] | None = None) -> Path:
    """Download a committed artifact's files into ``dest``, verifying each one.

    Every listed name is checked (``local_paths``) before the first byte is written.
    """
    bucket_name, base = gcs.split_uri(manifest.prefix)
    bucket = gcs.client().bucket(bucket_name)
    wanted = set(only) if only is not None else None
    targets = local_paths(dest, manifest.files, what=f"manifest {manifest.uri}")
    for name, meta in sorted(manifest.files.items()):
        if wanted is not None and name not in wanted:
            continue
        object_name = f"{base}/{name}" if base else name
        _download_verified(bucket, object_name, targets[name], name, meta["size"], meta["crc32c"], manifest.prefix)
    return dest


def source_files(uri: str) -> dict[str, dict[str, Any]]:
    """The file table of a source that is not a loraflow artifact (a dataset, an HF checkpoint).

    ``uri`` is one object or a prefix ("directory"); sizes and checksums come from GCS itself.
    """
    bucket_name, path = gcs.split_uri(uri)
    bucket = gcs.client().bucket(bucket_name)
    blob = bucket.get_blob(path) if path and not path.endswith("/") else None
    if blob is not None:
        return {os.path.basename(path): {"size": blob.size, "crc32c": blob.crc32c, "object": path}}
    base = path.rstrip("/") + "/" if path else ""
    files = {
        b.name[len(base) :]: {"size": b.size, "crc32c": b.crc32c, "object": b.name}
        for b in gcs.client().list_blobs(bucket_name, prefix=base)
        if not b.name.endswith("/")
    }
    if not files:
        raise ArtifactError(f"source {uri} does not exist (no object and no files under that prefix)")
    for name in files:  # refused here, before any key is computed or any byte downloaded
        check_name(name, what=f"source {uri}")
    return files


def fetch_source(uri: str, dest: Path, files: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Download a source into ``dest``: every object name is checked (``local_paths``) before any is.

    ``files`` is a listing already taken (``source_files``): each object is verified against it, so
    what lands in ``dest`` has exactly that listing's fingerprint, or the fetch fails.
    """
    files = source_files(uri) if files is None else files
    targets = local_paths(dest, files, what=f"source {uri}")
    bucket = gcs.client().bucket(gcs.split_uri(uri)[0])
    for name, meta in sorted(files.items()):
        _download_verified(bucket, meta["object"], targets[name], name, meta["size"], meta["crc32c"], uri)
    return files


# ------------------------------------------------------------------------------------- the cache


def cache_entry_uri(artifact_root: str, stage: str, key: str) -> str:
    return gcs.join(artifact_root, "_cache", stage, f"{key}.json")


_RUN_SEGMENT = r"[A-Za-z0-9._-]+"
_PIPELINE_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"


def stage_manifest_problem(uri: Any, artifact_root: str, stage: str, pipeline: str | None = None) -> str | None:
    """Why ``uri`` is not the manifest of a commit of ``stage`` under ``artifact_root``, or None.

    Such a manifest is ``{artifact_root}/PIPELINE/RUN/{stage}[-KEY12]/_MANIFEST.json``: same bucket,
    inside the root, not in ``_cache`` or ``_registry``, and of the stage asked for (and of ``pipeline``,
    when given). This is the only shape a cache entry or a registry version may point at.
    """
    root = artifact_root.rstrip("/") + "/"
    if not isinstance(uri, str) or not uri:
        return f"it is {uri!r}, not a gs:// URI"
    if not uri.startswith(root):
        return f"it lies outside the artifact root {artifact_root}"
    try:
        gcs.split_uri(uri)
    except ArtifactError as exc:
        return str(exc)
    shape = rf"({_PIPELINE_SEGMENT})/({_RUN_SEGMENT})/([^/]+)/{re.escape(MANIFEST)}"
    match = re.fullmatch(shape, uri[len(root) :])
    if match is None:
        return f"it is not {root}PIPELINE/RUN/{stage}/{MANIFEST}"
    if not re.fullmatch(rf"{re.escape(stage)}(-[0-9a-f]{{12}})?", match[3]):
        return f"it is a commit of {match[3]!r}, not of stage {stage}"
    if pipeline is not None and match[1] != pipeline:
        return f"it is a commit of pipeline {match[1]!r}, not of {pipeline}"
    return None


def cache_lookup(artifact_root: str, stage: str, key: str) -> Manifest | None:
    """The committed manifest cached under ``key``, if it is still whole; else None.

    An entry that points anywhere but at a commit of ``stage`` under ``artifact_root``
    (``stage_manifest_problem``), or at a manifest that is not whole, is a miss: the stage runs and
    its commit replaces the entry. The log says why.
    """
    entry_uri = cache_entry_uri(artifact_root, stage, key)
    try:
        entry = read_json_object(entry_uri)
    except JsonObjectError as exc:
        log.warning("cache entry %s is refused: it %s; treating it as a miss", entry_uri, exc.problem)
        return None
    if entry is None:
        return None
    pointer = entry.get("manifest")
    problem = stage_manifest_problem(pointer, artifact_root, stage)
    if problem:
        log.warning(
            "cache entry %s points at %r, which is refused: %s; treating it as a miss", entry_uri, pointer, problem
        )
        return None
    try:
        manifest = read_manifest(str(pointer))
    except ArtifactError as exc:
        log.warning("cache entry %s is stale: %s; treating it as a miss", entry_uri, exc)
        return None
    if manifest.data.get("stage") not in (stage, manifest.prefix.rsplit("/", 1)[-1]):
        log.warning(
            "cache entry %s points at a manifest of stage %r; treating it as a miss",
            entry_uri,
            manifest.data.get("stage"),
        )
        return None
    if manifest.data.get("cache_key") != key or not _files_present(manifest):
        log.warning("cache entry for %s/%s does not match its manifest; ignoring it", stage, key)
        return None
    return manifest


def _files_present(manifest: Manifest) -> bool:
    bucket_name, base = gcs.split_uri(manifest.prefix)
    listed = {
        b.name[len(base) + 1 :]: (b.size, b.crc32c) for b in gcs.client().list_blobs(bucket_name, prefix=base + "/")
    }
    return all(listed.get(n) == (m["size"], m["crc32c"]) for n, m in manifest.files.items())


def cache_store(artifact_root: str, stage: str, key: str, manifest: Manifest) -> None:
    problem = stage_manifest_problem(manifest.uri, artifact_root, stage)
    if problem:  # never write an entry that cache_lookup would refuse
        raise ArtifactError(f"{manifest.uri} is not cached as {stage}: {problem}")
    write_json(cache_entry_uri(artifact_root, stage, key), {"manifest": manifest.uri, "stage": stage})
