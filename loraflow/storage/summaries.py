"""The gate's and publish's summaries, typed: what other modules read of those two stages, parsed once.

The gate records its decision twice: ``decision.json`` (these fields and the evidence) and its manifest's
``summary`` (the XCom the publish task, the notices and the hand-off verdict read, the Airflow run
``loraflow runs`` describes, the commit the registry checks a champion against). Publish's summary says
whether it registered a version. Anyone who can write the bucket (or an XCom) can write either, so each is
read through :meth:`GateSummary.from_object` / :meth:`PublishSummary.from_object`: a field of the wrong type
is one ``SummaryError`` naming the object, the field and the fix, never a ``.get`` that reads "yes" as true.
Fields older summaries lack (``metric``, ``confidence``, ``champion_version``) read as None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.storage import json_objects
from loraflow.storage.json_objects import JsonObjectError

RERUN_GATE = "re-run the gate stage, which writes it"
RERUN_PUBLISH = "re-run the publish stage, which writes it"
_MISSING = object()


class SummaryError(JsonObjectError):
    """A gate or publish summary that is not one loraflow wrote: a field missing or of the wrong type."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _interval(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_number(x) for x in value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: What each field may hold, said as the error says it.
_KINDS = {
    "a boolean": lambda v: isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a number": _number,
    "a whole number": _count,
    "two numbers": _interval,
}


class _Reader:
    """One summary's fields, each checked against its kind; the first wrong one is a ``SummaryError``."""

    def __init__(self, data: object, where: str, what: str, fix: str) -> None:
        if not isinstance(data, Mapping):
            raise SummaryError(where, f"is not {what} (it holds a {type(data).__name__}, not a JSON object)", fix)
        self.data, self.where, self.what, self.fix = data, where, what, fix

    def field(self, key: str, kind: str, *, required: bool = False) -> Any:
        value = self.data.get(key, _MISSING)
        if value is _MISSING or (value is None and not required):
            if required:
                raise SummaryError(self.where, f"is not {self.what} (it has no {key!r})", self.fix)
            return None
        if not _KINDS[kind](value):
            raise SummaryError(self.where, f"is not {self.what} (its {key!r} is {value!r:.60}, not {kind})", self.fix)
        return value


def _xcom_summary(value: object) -> object:
    return value.get("summary") if isinstance(value, Mapping) else None


@dataclass(frozen=True)
class GateSummary:
    """The gate's verdict as the other stages, the notices, the hand-off and the registry read it."""

    promote: bool
    reason: str
    # The gate's settings as it recorded them; None in a summary written before it did. No default here:
    # a setting's one default is the spec schema's (tests/control/test_defaults_once.py).
    metric: str | None  # what base, tuned and delta measure
    confidence: float | None  # the level of ``ci``
    base: float | None = None
    tuned: float | None = None
    delta: float | None = None
    ci: tuple[float, float] | None = None  # the ``confidence`` interval of the gain
    champion_version: int | None = None

    @classmethod
    def from_object(cls, data: object, where: str) -> GateSummary:
        """The summary in ``data`` (decision.json's object or the manifest's ``summary``), found at ``where``."""
        read = _Reader(data, where, "a gate summary loraflow wrote", RERUN_GATE)
        ci = read.field("ci", "two numbers")
        return cls(
            promote=read.field("promote", "a boolean", required=True),
            reason=read.field("reason", "a string") or "",
            metric=read.field("metric", "a string"),
            base=read.field("base", "a number"),
            tuned=read.field("tuned", "a number"),
            delta=read.field("delta", "a number"),
            ci=(ci[0], ci[1]) if ci else None,
            confidence=read.field("confidence", "a number"),
            champion_version=read.field("champion_version", "a whole number"),
        )

    @classmethod
    def read(cls, path: Path) -> GateSummary:
        """The gate's decision file, fetched to ``path`` (bounded like every JSON object loraflow reads)."""
        return cls.from_object(json_objects.read_file_object(path, fix=RERUN_GATE), str(path))

    @classmethod
    def from_xcom(cls, value: object) -> GateSummary | None:
        """The gate task's summary from its XCom (a stage task returns ``{"summary": ..., ...}``); None
        when the gate pushed none (it did not run)."""
        summary = _xcom_summary(value)
        return None if summary is None else cls.from_object(summary, "the gate task's summary (XCom)")


@dataclass(frozen=True)
class PublishSummary:
    """Publish's outcome: whether it registered a version, which, and of which model."""

    promoted: bool
    version: int | None = None
    model_manifest: str | None = None

    @classmethod
    def from_object(cls, data: object, where: str) -> PublishSummary:
        read = _Reader(data, where, "a publish summary loraflow wrote", RERUN_PUBLISH)
        return cls(
            promoted=read.field("promoted", "a boolean", required=True),
            version=read.field("version", "a whole number"),
            model_manifest=read.field("model_manifest", "a string"),
        )

    @classmethod
    def from_xcom(cls, value: object) -> PublishSummary | None:
        """The publish task's summary from its XCom; None when publish pushed none (skipped, failed)."""
        summary = _xcom_summary(value)
        return None if summary is None else cls.from_object(summary, "the publish task's summary (XCom)")
