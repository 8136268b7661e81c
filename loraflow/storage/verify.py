"""Re-checking a committed artifact where it lies in GCS (``loraflow verify``, a registry promote).

The manifest must be whole (``artifacts.read_manifest``: present, written for this prefix, a table of
safe names) and every file it lists must be in GCS with the size and crc32c it records. GCS computes
an object's crc32c from the bytes it stores, so comparing it with the manifest checks the stored
bytes without downloading them; ``download=True`` also downloads every file and checksums it here
(what a reader of the artifact would see).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loraflow.errors import ArtifactError
from loraflow.storage import artifacts, gcs


@dataclass(frozen=True)
class Verification:
    manifest: artifacts.Manifest
    problems: list[str] = field(default_factory=list)
    downloaded: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def checked(self) -> int:
        return len(self.manifest.files)


def verify_artifact(uri: str, download: bool = False) -> Verification:
    """Check the committed artifact at ``uri`` (its prefix or its manifest); every problem found, each
    naming the file. A manifest that cannot be trusted, or a URI of no bucket GCS allows, raises
    ``ArtifactError``."""
    try:
        gcs.check_bucket(gcs.split_uri(uri)[0])
    except ValueError as exc:  # google-cloud-storage would raise it bare, with no word of the URI
        raise ArtifactError(f"{uri!r}: {exc}") from None
    manifest = artifacts.read_manifest(uri)
    bucket_name, base = gcs.split_uri(manifest.prefix)
    start = base.rstrip("/") + "/" if base else ""
    stored = {b.name[len(start) :]: b for b in gcs.client().list_blobs(bucket_name, prefix=start)}
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="loraflow-verify-") as scratch:
        for name, meta in sorted(manifest.files.items()):
            blob = stored.get(name)
            if blob is None:
                problems.append(f"{name}: listed in the manifest, missing from GCS")
                continue
            if blob.size != meta["size"]:
                problems.append(f"{name}: {blob.size} bytes in GCS, the manifest says {meta['size']}")
            elif blob.crc32c != meta["crc32c"]:
                problems.append(f"{name}: crc32c {blob.crc32c} in GCS, the manifest says {meta['crc32c']}")
            elif download:
                size, crc = artifacts.download_with_crc32c(blob, Path(scratch) / "file")
                if (size, crc) != (meta["size"], meta["crc32c"]):
                    problems.append(
                        f"{name}: downloaded {size} bytes with crc32c {crc}, the manifest says "
                        f"{meta['size']} bytes, {meta['crc32c']}"
                    )
    return Verification(manifest, problems, download)
