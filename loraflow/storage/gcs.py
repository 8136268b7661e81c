"""The one place that builds a Google Cloud Storage client, splits ``gs://`` URIs and checks a bucket name.

Locally ``STORAGE_EMULATOR_HOST`` points at the GCS emulator; the client library honours it and we
talk to it anonymously. In production the default credentials of the host (Airflow worker, Vertex
job, GKE pod) are used. Either way the code path is the same ``google-cloud-storage`` client.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import TYPE_CHECKING

from loraflow.errors import ArtifactError

if TYPE_CHECKING:
    from google.cloud import storage  # type: ignore[attr-defined]


def split_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ``("bucket", "a/b")``; anything else is refused."""
    if not uri.startswith("gs://"):
        raise ArtifactError(f"{uri!r} is not a gs:// URI; artifacts live in GCS (gs://BUCKET/PATH)")
    bucket, _, path = uri[len("gs://") :].partition("/")
    if not bucket:
        raise ArtifactError(f"{uri!r} names no bucket; write gs://BUCKET/PATH")
    if any(c in uri for c in "\r\n\x00"):  # GCS refuses CR and LF in object names; NUL is never meant
        raise ArtifactError(f"{uri!r} contains a line break or NUL; GCS names cannot hold them")
    if any(part in {"..", "."} for part in path.split("/")):
        raise ArtifactError(
            f"{uri!r} contains '.' or '..' segments; write the full path (nothing may escape its prefix)"
        )
    return bucket, path


def join(prefix: str, *parts: str) -> str:
    out = prefix.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


@lru_cache(maxsize=1)
def client() -> storage.Client:
    from google.cloud import storage  # type: ignore[attr-defined]

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "loraflow-local")
        made = storage.Client(project=project, credentials=AnonymousCredentials())
    else:
        made = storage.Client()
    if os.environ.get("ENABLE_GCS_PYTHON_CLIENT_OTEL_TRACES", "").strip().lower() not in {"1", "true", "yes", "on"}:
        # The client's bucket-metadata cache only labels OpenTelemetry spans, which are off: without
        # it, no background thread fetches each bucket's metadata (one more request per bucket and
        # client) or re-checks a bucket after every 404 (each cache miss is one). Such a thread, alive
        # when a task launches its step, would keep the step from being forked (launchers/forked_step.py).
        made._bucket_metadata_cache = None
    return made


# A forked process (a step forked from its task: loraflow/launchers/forked_step.py) builds its own
# client: the parent's pooled HTTP connections must not be shared.
os.register_at_fork(after_in_child=client.cache_clear)


def route_native_clients() -> None:
    """Point the other GCS clients of a step at the emulator too, when there is one.

    Orbax writing ``gs://`` itself (``training.checkpoint_storage: direct``) goes through tensorstore's
    GCS driver (array data) and gcsfs (directories, metadata). gcsfs honours ``STORAGE_EMULATOR_HOST``;
    tensorstore reads its endpoint from ``TENSORSTORE_GCS_HTTP_URL``. With no emulator (production)
    nothing changes: both use the host's default credentials against GCS.
    """
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    import logging

    # gcsfs warns on every bucket it opens that it found no default credentials: expected here.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)


def check_bucket(bucket: str) -> str:
    """``bucket`` if it is a GCS bucket name: 3-63 characters of a-z, 0-9, '-', '_' (dotted names up
    to 222, each part at most 63), starting and ending with a letter or digit; else ValueError."""
    parts = bucket.split(".")
    if not (
        re.fullmatch(r"[a-z0-9][a-z0-9._-]*[a-z0-9]", bucket)
        and 3 <= len(bucket) <= (222 if len(parts) > 1 else 63)
        and all(0 < len(p) <= 63 for p in parts)
    ):
        raise ValueError(
            f"{bucket!r} is not a GCS bucket name; use 3-63 lowercase letters, digits, '-' and '_' "
            "(dots only between parts), starting and ending with a letter or digit"
        )
    return bucket
