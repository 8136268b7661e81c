"""Where a browser opens an object of the artifact store: the GCS emulator locally, the Cloud console's
authenticated URL in GCP; and where validate_data keeps Great Expectations' data docs. The task links,
the run report, notices and the demo use them."""

from __future__ import annotations

import urllib.parse

from loraflow.storage import gcs


def browser_url(uri: str, emulator_host: str | None = None) -> str:
    """An http(s) URL a browser opens ``gs://BUCKET/PATH`` at.

    With a GCS emulator (``STORAGE_EMULATOR_HOST``) it is the emulator's media download URL;
    otherwise https://storage.cloud.google.com/BUCKET/PATH (served to the signed-in user).
    """
    bucket, path = gcs.split_uri(uri)
    if emulator_host:
        quoted = urllib.parse.quote(path, safe="")
        return f"{_emulator_url(emulator_host)}/download/storage/v1/b/{bucket}/o/{quoted}?alt=media"
    return f"https://storage.cloud.google.com/{bucket}/{urllib.parse.quote(path)}"


def site_url(uri: str, emulator_host: str | None = None) -> str:
    """Like ``browser_url``, for a page that links to its neighbours (GX's data docs).

    The emulator's download URL encodes the object path as one segment, which breaks a page's
    relative links; its public-object route (``/BUCKET/PATH``) keeps the slashes, as the Cloud
    console's URL does.
    """
    if not emulator_host:
        return browser_url(uri)
    bucket, path = gcs.split_uri(uri)
    return f"{_emulator_url(emulator_host)}/{bucket}/{urllib.parse.quote(path)}"


def _emulator_url(emulator_host: str) -> str:
    """The emulator's base URL: ``STORAGE_EMULATOR_HOST`` (``HOST:PORT`` means http://HOST:PORT)."""
    host = emulator_host.rstrip("/")
    return host if "://" in host else f"http://{host}"


# Where validate_data keeps Great Expectations' data docs, under its stage prefix: with the committed
# artifact, or with the rejection evidence (``_rejected/``) when the data broke its contract.
DATA_DOCS_INDEX = "data_docs/index.html"
REJECTED = "_rejected"


def data_docs_uri(stage_prefix: str, rejected: bool = False) -> str:
    return gcs.join(stage_prefix, *([REJECTED] if rejected else []), DATA_DOCS_INDEX)
