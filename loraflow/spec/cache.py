"""What a DAG needs from each pipeline spec, validated once and then read back from a cache.

Airflow parses ``dags/`` again every 30 s in the DAG processor and once more in every task process.
Validating a spec costs the pydantic models (~50 ms to import), PyYAML's construction and the stage
table's upstream walk, yet a DAG needs only plain data from it: the validated spec as JSON and each stage's
upstream stages (``CompiledSpec``). ``compiled(path)`` reads that data from a cache entry when the
entry was made from the same spec file (name and bytes), the same loraflow code and the same Python,
pydantic and PyYAML versions; otherwise it validates the spec and writes the entry. A spec that
fails validation is never cached: it is validated, and reported, on every parse. Nothing here
imports the spec models unless a spec has to be validated.

The cache is a directory of small JSON files, one per spec name (an edited spec replaces its entry):
``$LORAFLOW_SPEC_CACHE_DIR``, by default ``~/.cache/loraflow/specs``; ``off`` turns it off. Entries are
written to a temporary file and renamed, so a concurrent parse never reads half an entry; a cache
that cannot be read or written costs speed, never a DAG.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from loraflow.spec.reader import read_spec_file

CACHE_ENV = "LORAFLOW_SPEC_CACHE_DIR"
_FORMAT = 1  # bump when CompiledSpec's fields change
_PACKAGE = Path(__file__).resolve().parents[1]
# The packages whose modules validation and planning may import (a test checks that they import no other).
_FINGERPRINTED = ("", "spec", "storage", "data", "evaluation", "models")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledSpec:
    """A valid pipeline spec as the DAG file uses it: plain JSON data, no pydantic models."""

    spec: dict[str, Any]  # the validated spec: PipelineSpec.model_dump(mode="json")
    upstream: dict[str, list[str]]  # every stage, in plan order -> the stages it runs after
    params: dict[str, dict[str, Any]]  # the trigger form's fields: loraflow.spec.schema.trigger_fields

    @property
    def name(self) -> str:
        return str(self.spec["name"])


def discover(folder: str | Path) -> list[Path]:
    """The spec files of a pipelines folder, in name order."""
    return sorted(Path(folder).glob("*.yaml"))


def compile_spec(text: bytes, path: Path) -> CompiledSpec:
    """Validate the spec file's contents and plan its stages (imports the spec models)."""
    from loraflow.spec.schema import parse_spec, trigger_fields
    from loraflow.spec.stages import STAGE_TABLE

    spec = parse_spec(text, path)
    upstream = {stage.name: list(stage.upstream(spec)) for stage in STAGE_TABLE}
    return CompiledSpec(spec.model_dump(mode="json"), upstream, trigger_fields(spec))


def compiled(path: Path, cache_dir: Path | None = None) -> CompiledSpec:
    """The spec file at ``path``, compiled: from the cache when it holds this very file, else
    validated (raising ``SpecError`` with every problem) and cached."""
    text = read_spec_file(path)  # size-capped, regular files only
    folder = default_cache_dir() if cache_dir is None else cache_dir
    if folder is None:
        return compile_spec(text, path)
    key = cache_key(path.name, text)
    entry = folder / f"{path.stem}.json"
    hit = _read(entry, key)
    if hit is not None:
        return hit
    result = compile_spec(text, path)
    _write(entry, key, result)
    return result


def default_cache_dir() -> Path | None:
    """``$LORAFLOW_SPEC_CACHE_DIR`` (``off``: no cache), else ``~/.cache/loraflow/specs``."""
    value = os.environ.get(CACHE_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value)
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "loraflow" / "specs"
    try:
        return Path.home() / ".cache" / "loraflow" / "specs"
    except (RuntimeError, KeyError) as exc:  # no HOME and no passwd entry (an arbitrary container uid)
        _warn_unwritable(Path("~/.cache/loraflow/specs"), OSError(f"no home directory: {exc}"))
        return None


def cache_key(file_name: str, text: bytes) -> str:
    h = hashlib.sha256(code_fingerprint().encode())
    h.update(file_name.encode() + b"\0" + text)
    return h.hexdigest()


@cache
def code_fingerprint() -> str:
    """What else decides a compiled spec: loraflow's own modules (validation and planning import only
    those of the _FINGERPRINTED packages; a test checks that), the Python, pydantic and PyYAML versions,
    the entry format."""
    import pydantic  # both loaded by Airflow already
    import yaml

    versions = f"{_FORMAT}|{sys.version}|{pydantic.VERSION}|{yaml.__version__}|{yaml.__with_libyaml__}"
    h = hashlib.sha256(versions.encode())
    for module in sorted(m for pkg in _FINGERPRINTED for m in (_PACKAGE / pkg).glob("*.py")):
        h.update(str(module.relative_to(_PACKAGE)).encode() + b"\0" + module.read_bytes())
    return h.hexdigest()


def _read(entry: Path, key: str) -> CompiledSpec | None:
    try:
        data = json.loads(entry.read_bytes())
        if data["key"] == key and all(isinstance(data[k], dict) for k in ("spec", "upstream", "params")):
            return CompiledSpec(data["spec"], data["upstream"], data["params"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable or not an entry: validate again
        log.debug("ignoring spec cache entry %s: %s", entry, exc)
    return None


def _write(entry: Path, key: str, result: CompiledSpec) -> None:
    body = json.dumps({"key": key, "spec": result.spec, "upstream": result.upstream, "params": result.params})
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=f".{entry.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(body)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        _warn_unwritable(entry.parent, exc)


_warned: set[Path] = set()


def _warn_unwritable(folder: Path, exc: OSError) -> None:
    if folder in _warned:
        return
    _warned.add(folder)
    log.warning(
        "spec cache %s cannot be written (%s): every parse validates every spec again. Point %s at a "
        "writable directory, or set it to 'off'.",
        folder,
        exc,
        CACHE_ENV,
    )
