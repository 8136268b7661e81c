"""The data-team hand-off: dataset versions under an agreed prefix, which run trains which, the verdict back.

A spec with a ``handoff`` section takes its dataset from there instead of fixed ``data.train`` /
``data.eval`` URIs (docs/data-handoff.md is the contract, written for data teams)::

    {prefix}/{version}/train.jsonl     handoff.train   the data team writes these first,
    {prefix}/{version}/eval.jsonl      handoff.eval    in any order,
    {prefix}/{version}/_READY                          then this marker, last: the version is complete
    {prefix}/{version}/_CLAIM          loraflow: the one run that trains this version (create-only)
    {prefix}/{version}/_RESULT.json    loraflow: the verdict, written when that run ends

A run picks exactly one version: the one named in the Asset event that triggered it (``extra.version``)
or else the newest version that is ready and neither claimed nor judged. Taking a version means creating
``_CLAIM`` with the precondition "only if absent" (``if_generation_match=0``): of two runs racing for
the same version one wins, the other moves on to the next candidate or picks nothing. So no version
trains twice, not even when polls overlap. GCS decides the race with the precondition itself (as
does the local emulator, fake-gcs-server): the claim is never read back to decide it.

Markers are written by whoever can write the prefix, so each is read with a byte cap
(``artifacts.read_json_object``) and a bad one costs only its own version: a ``_CLAIM`` that is not a
loraflow claim is skipped and reported (``Pick.skipped``: the task log and the verdict's ``skipped``),
a claim naming this run is honoured only on a version with its own ``_READY``, and only a version
folder's direct children are its markers and files (``v3/sub/_READY`` is not v3's).

Airflow-free: operators/handoff.py calls ``pick`` and ``finish``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraflow.errors import LoraflowError
from loraflow.reporting import notify, urls
from loraflow.spec.stages import DATA_REPORT
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary, PublishSummary

if TYPE_CHECKING:  # the DAG file imports this module for its task names; the spec models load at run time
    from loraflow.spec.schema import HandoffSpec, PipelineSpec

log = logging.getLogger(__name__)

READY = "_READY"
CLAIM = "_CLAIM"
RESULT = "_RESULT.json"
# Format names recorded in the objects (kept when this module left loraflow/data/: readers match them).
RESULT_FORMAT = "loraflow.data.handoff.result/1"
CLAIM_FORMAT = "loraflow.data.handoff.claim/1"
#: The most bytes read of a ``_CLAIM`` (loraflow writes about 150).
CLAIM_MAX_BYTES = 64 << 10
#: The most bytes read of a rejected dataset's data_report.json (validate_data caps what it lists).
REPORT_MAX_BYTES = 16 << 20
#: Airflow's limit for a dag_id and a run_id (ID_LEN): a claim naming longer ones was not written by loraflow.
_ID_MAX = 250
#: The most skipped versions a verdict lists (each is one line naming the version, the problem and the fix).
MAX_SKIPPED = 20
# Always fullmatch: with match() and '$', "v1\n" would pass (a '$' also matches before a final newline).
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]{0,127}")
PICK_TASK = "pick_dataset"
VERDICT_TASK = "handoff_verdict"
ACCEPTED, REJECTED, FAILED = "accepted", "rejected", "failed"


class HandoffError(LoraflowError):
    """A hand-off that cannot be used as given (a missing marker, a bad version name)."""


class BadClaimError(HandoffError):
    """A version's ``_CLAIM`` is not a loraflow claim: no run may take that version."""


def check_version(version: str) -> str:
    if not isinstance(version, str) or not VERSION_RE.fullmatch(version):
        raise HandoffError(
            f"dataset version {version!r} is not a valid name; use letters, digits, '.', '_', '=' or '-' "
            "(one path segment, e.g. 2026-12-03 or v7)"
        )
    return version


def version_uri(handoff: HandoffSpec, version: str) -> str:
    return gcs.join(handoff.prefix, check_version(version))


def verdict_asset_uri(pipeline: str) -> str:
    """The Asset the verdict of pipeline ``pipeline`` is announced on; data teams schedule their DAGs on it."""
    return f"loraflow://{pipeline}/verdict"


def apply_version(spec: PipelineSpec, version: str) -> PipelineSpec:
    """The spec as a run that trains ``version`` sees it: ``data.train``/``data.eval`` point into it."""
    from loraflow.spec.schema import with_overrides

    if spec.handoff is None:
        raise LoraflowError(f"pipeline {spec.name} has no handoff section; there is no dataset version to apply")
    base = version_uri(spec.handoff, version)
    overrides = {"data.train": gcs.join(base, spec.handoff.train), "data.eval": gcs.join(base, spec.handoff.eval)}
    return with_overrides(spec, overrides, source=f"dataset version {base}")


# ------------------------------------------------------------------------------------ state (pure)


@dataclass(frozen=True)
class VersionState:
    """What lies in one version's folder: its markers, and when ``_READY`` was written."""

    version: str
    ready_at: dt.datetime | None = None
    claimed: bool = False
    judged: bool = False
    files: frozenset[str] = field(default_factory=frozenset)

    @property
    def pending(self) -> bool:
        return self.ready_at is not None and not self.claimed and not self.judged


def candidates(states: list[VersionState]) -> list[str]:
    """Versions a run may take, best first: ready, unclaimed, unjudged; newest ``_READY`` first
    (ties broken by name, highest first). Older pending versions come next, on later polls."""
    pending = [s for s in states if s.pending]
    pending.sort(key=lambda s: (s.ready_at or dt.datetime.min.replace(tzinfo=dt.UTC), s.version), reverse=True)
    return [s.version for s in pending]


# ------------------------------------------------------------------------------------ GCS


def scan(handoff: HandoffSpec) -> list[VersionState]:
    """Every version folder under the hand-off prefix, with its markers."""
    bucket, path = gcs.split_uri(handoff.prefix)
    base = path.rstrip("/") + "/" if path else ""
    found: dict[str, dict[str, Any]] = {}
    for blob in gcs.client().list_blobs(bucket, prefix=base):
        rest = blob.name[len(base) :]
        version, sep, name = rest.partition("/")
        if not sep or not VERSION_RE.fullmatch(version) or "/" in name:
            continue
        entry = found.setdefault(version, {"files": set()})
        entry["files"].add(name)
        if name == READY:
            entry["ready_at"] = blob.time_created or blob.updated
    return [
        VersionState(
            version=v,
            ready_at=e.get("ready_at"),
            claimed=CLAIM in e["files"],
            judged=RESULT in e["files"],
            files=frozenset(e["files"]),
        )
        for v, e in found.items()
    ]


def state_of(handoff: HandoffSpec, version: str) -> VersionState:
    """One version's markers (an empty state when nothing lies there): its direct children only, as
    ``scan`` sees them (``v3/sub/_READY`` is no marker of v3)."""
    bucket, path = gcs.split_uri(version_uri(handoff, version))
    base = path + "/"
    blobs = {
        b.name[len(base) :]: b for b in gcs.client().list_blobs(bucket, prefix=base) if "/" not in b.name[len(base) :]
    }
    ready = blobs.get(READY)
    return VersionState(
        version,
        ready_at=(ready.time_created or ready.updated) if ready is not None else None,
        claimed=CLAIM in blobs,
        judged=RESULT in blobs,
        files=frozenset(blobs),
    )


def read_claim(handoff: HandoffSpec, version: str) -> dict[str, Any] | None:
    """The claim on ``version``, or None when there is none. BadClaimError when its ``_CLAIM`` is not a
    claim loraflow writes (larger than ``CLAIM_MAX_BYTES``, not a JSON object, no dag_id and run_id)."""
    uri = gcs.join(version_uri(handoff, version), CLAIM)
    try:
        held = artifacts.read_json_object(uri, max_bytes=CLAIM_MAX_BYTES)
    except artifacts.JsonObjectError as exc:
        raise _bad_claim(uri, exc.problem) from None
    if held is not None and not all(_is_id(held.get(k)) for k in ("dag_id", "run_id")):
        raise _bad_claim(uri, f"names no dag_id and run_id (strings of 1-{_ID_MAX} characters)")
    return held


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= _ID_MAX


def _bad_claim(uri: str, problem: str) -> BadClaimError:
    return BadClaimError(
        f"{uri} {problem}: it is not a claim loraflow writes, so no run takes that version; "
        "publish the data again under a new version name (or, if no run is training it, delete that _CLAIM)"
    )


def claim(handoff: HandoffSpec, version: str, dag_id: str, run_id: str) -> bool:
    """Take ``version`` for this run. True if this run holds the claim (also when it already did:
    a retried task keeps its version), False if another run holds it."""
    from google.api_core.exceptions import PreconditionFailed

    held = read_claim(handoff, version)
    if held is not None:
        return bool(held.get("dag_id") == dag_id and held.get("run_id") == run_id)
    bucket, path = gcs.split_uri(gcs.join(version_uri(handoff, version), CLAIM))
    body = {"format": CLAIM_FORMAT, "dag_id": dag_id, "run_id": run_id, "claimed_at": _now()}
    try:
        gcs.client().bucket(bucket).blob(path).upload_from_string(
            json.dumps(body, sort_keys=True), content_type="application/json", if_generation_match=0
        )
    except PreconditionFailed:
        return False  # another run created it between our read and our write
    return True


@dataclass(frozen=True)
class Pick:
    """What a run takes: a version (with its dataset URIs) or nothing, with the reason."""

    version: str | None
    reason: str
    uri: str | None = None
    train: str | None = None
    eval: str | None = None
    skipped: tuple[str, ...] = ()  # versions passed over for a bad marker, each with why and the fix

    def to_xcom(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "reason": self.reason,
            "uri": self.uri,
            "train": self.train,
            "eval": self.eval,
            "skipped": list(self.skipped),
        }


def _picked(handoff: HandoffSpec, version: str, reason: str, skipped: list[str]) -> Pick:
    base = version_uri(handoff, version)
    return Pick(version, reason, base, gcs.join(base, handoff.train), gcs.join(base, handoff.eval), tuple(skipped))


def pick(handoff: HandoffSpec, dag_id: str, run_id: str, requested: str | None = None) -> Pick:
    """The version this run trains. ``requested`` (from an Asset event) must be ready; a version
    that was already claimed or judged is not taken again, whoever asks.

    Polling, a version with a bad marker is skipped, never the end of the pick: ``Pick.skipped`` says
    which and why. A version named by an event is refused with HandoffError instead (the run is for it).
    """
    if requested is not None:
        state = state_of(handoff, check_version(requested))
        uri = version_uri(handoff, requested)
        if state.ready_at is None:
            raise HandoffError(
                f"dataset version {uri} has no {READY} marker (files there: {sorted(state.files) or 'none'}); "
                f"upload the files, then write {uri}/{READY} last, then post the event"
            )
        if state.judged:
            return Pick(None, f"{uri} was already judged ({RESULT} exists); nothing to train")
        missing = [n for n in (handoff.train, handoff.eval) if n not in state.files]
        if missing:
            raise HandoffError(f"dataset version {uri} is marked ready but lacks {missing}; upload them")
        if not claim(handoff, requested, dag_id, run_id):
            held = read_claim(handoff, requested) or {}
            return Pick(None, f"{uri} is being trained by run {held.get('run_id')} of {held.get('dag_id')}")
        return _picked(handoff, requested, "named by the triggering asset event", [])
    states = scan(handoff)
    skipped: list[str] = []
    for state in states:  # a retried pick keeps the version its first try claimed
        if state.claimed and not state.judged and _holds(handoff, state, dag_id, run_id, skipped):
            return _picked(handoff, state.version, "claimed by an earlier try of this run", skipped)
    for version in candidates(states):
        try:
            if claim(handoff, version, dag_id, run_id):
                return _picked(handoff, version, f"the newest ready version under {handoff.prefix}", skipped)
        except BadClaimError as exc:  # a claim written between the scan and the look
            skipped.append(str(exc))
    return Pick(None, f"no ready, untrained dataset version under {handoff.prefix}", skipped=tuple(skipped))


def _holds(handoff: HandoffSpec, state: VersionState, dag_id: str, run_id: str, skipped: list[str]) -> bool:
    """Whether this run holds ``state``'s claim (a retried pick) and may train it: only a ready version
    (loraflow claims no other, so a claim naming this run on one without ``_READY`` was forged). A bad
    claim or a claim like that is added to ``skipped``."""
    try:
        held = read_claim(handoff, state.version)
    except BadClaimError as exc:
        skipped.append(str(exc))
        return False
    if held is None or held.get("dag_id") != dag_id or held.get("run_id") != run_id:
        return False
    if state.ready_at is None:
        uri = version_uri(handoff, state.version)
        skipped.append(
            f"{uri}/{CLAIM} names this run but the version has no {READY} marker of its own: not taken "
            f"(loraflow claims only ready versions, so that claim was written by someone else); write {uri}/{READY} "
            "last when the version is complete, or publish it under a new version name"
        )
        return False
    return True


def requested_version(events: list[dict[str, Any]]) -> str | None:
    """The dataset version named by the triggering Asset events' extras (the latest event wins)."""
    version = None
    for extra in events:
        value = (extra or {}).get("version")
        if value:
            version = str(value)
    return version


def drop_version(handoff: HandoffSpec, version: str, files: dict[str, Path]) -> str:
    """The data team's side, for scripts and tests: upload a version's files, then ``_READY`` last."""
    base = version_uri(handoff, version)
    bucket_name, path = gcs.split_uri(base)
    bucket = gcs.client().bucket(bucket_name)
    for name, local in files.items():
        bucket.blob(f"{path}/{name}").upload_from_filename(str(local), checksum="crc32c")
    bucket.blob(f"{path}/{READY}").upload_from_string(b"", content_type="text/plain")
    return base


# ------------------------------------------------------------------------------------ the verdict


def data_failures(run_prefix: str) -> list[str]:
    """The data contract's failed rules, from the report validate_data keeps when it rejects a dataset."""
    uri = gcs.join(run_prefix, "validate_data", urls.REJECTED, DATA_REPORT)
    try:
        report = artifacts.read_json_object(uri, max_bytes=REPORT_MAX_BYTES)
    except artifacts.JsonObjectError as exc:
        log.warning("the data report %s cannot be read (%s); the verdict names no data-contract rule", uri, exc.problem)
        return []
    if not report:
        return []
    listed = [report.get("load_problems"), report.get("failures")]
    if not all(isinstance(items, list | None) for items in listed):
        log.warning("the data report %s lists its problems as no list; the verdict names no data-contract rule", uri)
        return []
    return [str(f) for items in listed for f in (items or [])]


def judge(
    states: dict[str, str | None],
    rejected_data: list[str],
    decision: GateSummary | None,
    published: PublishSummary | None,
) -> tuple[str, list[str]]:
    """(verdict, reasons) of a finished run: accepted (a model was promoted), rejected (the data
    contract or the quality gate said no) or failed (something broke; not the data's fault)."""
    if rejected_data:
        return REJECTED, [f"data contract: {f}" for f in rejected_data]
    failed = sorted(t for t, s in states.items() if s == "failed")
    if failed:
        return FAILED, [f"task {t} failed; see its log in Airflow" for t in failed]
    if published and published.promoted:
        return ACCEPTED, [(decision and decision.reason) or "the quality gate promoted the tuned model"]
    if decision is not None and not decision.promote:
        return REJECTED, [f"quality gate: {decision.reason or 'the tuned model was not better'}"]
    unfinished = sorted(t for t, s in states.items() if s not in ("success", "skipped"))
    return FAILED, [f"the run ended before a decision (tasks not done: {', '.join(unfinished) or 'none'})"]


def result_document(
    spec: PipelineSpec,
    dag_id: str,
    run_id: str,
    version: str,
    verdict: str,
    reasons: list[str],
    published: PublishSummary | None,
    decision: GateSummary | None,
    report: str | None,
    report_url: str | None,
    skipped: list[str] | None = None,
) -> dict[str, Any]:
    """The ``_RESULT.json`` a data team reads (fields documented in docs/data-handoff.md); ``skipped``: the
    other versions this run's pick passed over for a bad marker (``Pick.skipped``)."""
    assert spec.handoff is not None
    model = None
    if published and published.promoted:
        model = {
            "version": published.version,
            "registry": gcs.join(spec.registry_uri, spec.name),
            "model_manifest": published.model_manifest,
        }
    gate = None
    if decision:
        figures = {"base": decision.base, "tuned": decision.tuned, "delta": decision.delta, "ci": decision.ci}
        recorded = {k: list(v) if isinstance(v, tuple) else v for k, v in figures.items() if v is not None}
        gate = {"promote": decision.promote, **recorded, "reason": decision.reason}
    return {
        "format": RESULT_FORMAT,
        "pipeline": spec.name,
        "dag_id": dag_id,
        "run_id": run_id,
        "dataset": version_uri(spec.handoff, version),
        "version": version,
        "verdict": verdict,
        "reasons": notify.capped_reasons(reasons),  # they quote the dataset: the whole list is in data_report.json
        "model": model,
        "gate": gate,
        "report": report,
        "report_url": report_url,
        "artifacts": gcs.join(spec.artifact_root, spec.name, artifacts.safe_run_id(run_id)),
        "skipped": [str(s) for s in (skipped or [])][:MAX_SKIPPED],
        "finished_at": _now(),
    }


def write_result(spec: PipelineSpec, version: str, document: dict[str, Any]) -> str:
    """Write ``_RESULT.json`` beside the dataset version (a retried verdict task rewrites its own)."""
    assert spec.handoff is not None
    uri = gcs.join(version_uri(spec.handoff, version), RESULT)
    bucket, path = gcs.split_uri(uri)
    gcs.client().bucket(bucket).blob(path).upload_from_string(
        json.dumps(document, indent=2, sort_keys=True), content_type="application/json"
    )
    return uri


def event_extra(document: dict[str, Any], result_uri: str) -> dict[str, Any]:
    """The verdict Asset event's extra: small, the fields a downstream DAG branches on (capped: its
    reasons quote the dataset)."""
    model = document.get("model") or {}
    extra = {
        "pipeline": document["pipeline"],
        "version": document["version"],
        "dataset": document["dataset"],
        "verdict": document["verdict"],
        "reasons": document["reasons"][:10],
        "model_version": model.get("version"),
        "result": result_uri,
        "report": document.get("report"),
        "run_id": document["run_id"],
    }
    return dict(notify.capped_json(extra, notify.MAX_EXTRA_BYTES))


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
