"""Every JSON object loraflow reads from storage that others can write, parsed one way.

Manifests, cache entries, checkpoint markers, registry versions and aliases, hand-off claims, an
artifact's decision and metrics files and each row of a guard set are written as one JSON object; anyone
who can write the bucket (or hand in the file) can put anything there instead. :func:`parse_object` takes
only UTF-8 text, nested at most :data:`MAX_DEPTH` deep (counted by a scan of the raw text before
``json.loads`` runs, so the json module is never asked to recurse 100,000 levels and RecursionError cannot
arise), holding a JSON object at the top. The readers bound the bytes first: a GCS read is ranged, so a
200 MB object costs the cap, never its size. A refusal is a ``JsonObjectError`` naming the object, what is
wrong and the fix; each caller decides what it means (a cache miss, a refused champion, a failed step).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

from loraflow.errors import ArtifactError

#: Deepest nesting accepted: what loraflow writes is a few levels deep (a manifest's file table is 3).
MAX_DEPTH = 64
#: Markers, pointers, cache entries and aliases are a few hundred bytes.
SMALL_MAX_BYTES = 64 << 10
#: Manifests, checkpoint markers, metrics, decisions, reports: a manifest of 100,000 files fits.
DOCUMENT_MAX_BYTES = 16 << 20

REWRITE = (
    "loraflow writes it as one JSON object, so it was damaged or written by another hand: restore it, or "
    "delete it and re-run what writes it"
)

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # escapes included
_NOT_BRACKET = re.compile(r"[^][{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class NotAnObject(ValueError):
    """``parse_object``'s refusal; the message is the problem, as in "is not JSON (...)"."""


class JsonObjectError(ArtifactError):
    """An object that should hold one JSON object does not: too large, not JSON, too deep, not an object."""

    def __init__(self, where: str, problem: str, fix: str = REWRITE) -> None:
        self.uri, self.problem = where, problem
        super().__init__(f"{where} {problem}; {fix}")


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text``: its brackets outside strings, counted in C (no
    Python step per character), so 16 MiB cost a fraction of a second and 100,000 levels nothing."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def parse_object(data: bytes | str, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """The JSON object ``data`` holds; ``NotAnObject`` naming the problem otherwise."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise NotAnObject(f"is not JSON (not UTF-8: byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    if nesting_depth(data) > max_depth:
        raise NotAnObject(f"is not JSON loraflow reads (nested deeper than {max_depth} levels)")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise NotAnObject(f"is not JSON ({str(exc)[:200]})") from None
    if not isinstance(value, dict):
        raise NotAnObject(f"is not a JSON object (it holds a {type(value).__name__})")
    return value


def read_json_object(uri: str, *, max_bytes: int = SMALL_MAX_BYTES, blob: Any = None) -> dict[str, Any] | None:
    """The JSON object stored at ``gs://`` ``uri``, or None when there is none; at most ``max_bytes`` are
    downloaded and anything but one JSON object is refused (``JsonObjectError``). ``blob``: the object
    already looked up (publish holds it for its generation); it is read as it is."""
    from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

    from loraflow.storage import gcs  # here: the spec schema imports this module (guard sets) but no storage

    if blob is None:
        bucket, path = gcs.split_uri(uri)
        blob = gcs.client().bucket(bucket).blob(path)
    if isinstance(blob.size, int) and blob.size > max_bytes:  # known from a listing: not even the first bytes
        raise JsonObjectError(uri, f"is larger than {max_bytes} bytes ({blob.size})")
    try:
        data = blob.download_as_bytes(start=0, end=max_bytes, checksum=None)  # ``end`` is inclusive
    except NotFound:
        return None
    except RequestRangeNotSatisfiable:  # GCS answers a range on an empty object so
        data = b""
    return _checked(uri, data, max_bytes)


def read_file_object(path: Path, *, max_bytes: int = DOCUMENT_MAX_BYTES, fix: str = REWRITE) -> dict[str, Any]:
    """The JSON object in the local file ``path`` (an artifact's file, fetched), read as from GCS."""
    with open(path, "rb") as fh:
        return _checked(str(path), fh.read(max_bytes + 1), max_bytes, fix)


def _checked(where: str, data: bytes, max_bytes: int, fix: str = REWRITE) -> dict[str, Any]:
    if len(data) > max_bytes:
        raise JsonObjectError(where, f"is larger than {max_bytes} bytes", fix)
    try:
        return parse_object(data)
    except NotAnObject as exc:
        raise JsonObjectError(where, str(exc), fix) from None
