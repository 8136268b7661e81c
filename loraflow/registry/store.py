"""Reading a pipeline's model registry in GCS (written by ``loraflow.steps.publish``).

Layout under ``{registry_uri}/{pipeline}/``: ``versions/NNNN.json`` (one per promoted model,
never overwritten) and ``aliases/champion.json`` (points at the current champion's version).

Anyone who can write the bucket can write these files, so the gate trusts nothing a version entry
merely says. ``champion`` follows the alias only to a version of this registry and anchors it in the
version's own run of this pipeline: the committed gate of that run (under
``{artifact_root}/{pipeline}/{run}/``) must have promoted it, the committed ``evaluate_tuned`` that gate
judged must be of the version's model, and that model a committed ``merge_adapter`` with the
fingerprint the version records. (The model and its evaluation may lie under another run or pipeline:
a cache hit reuses their commits; the run's own gate is what ties them to this pipeline.) The gate
measures the champion's figure from that evaluation's predictions, each file checked against its
manifest, never from the number the entry records.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from loraflow.errors import ArtifactError
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary, SummaryError

CHAMPION = "champion"
MODEL_STAGE = "merge_adapter"
EVALUATION_STAGE = "evaluate_tuned"
GATE_STAGE = "gate"
#: The most bytes read of an alias (publish writes about 600).
ALIAS_MAX_BYTES = 64 << 10
#: The most bytes read of a version entry: publish writes a few kB; versions registered before it kept
#: only the scalars of the decision's metrics embedded both evaluations' per-example lists.
VERSION_MAX_BYTES = 16 << 20
_VERSION_NAME = re.compile(r"([0-9]{4,})\.json")  # fullmatch; ASCII digits ('\d' takes any script's)


def alias_uri(registry_uri: str, pipeline: str, alias: str = CHAMPION) -> str:
    return gcs.join(registry_uri, pipeline, "aliases", f"{alias}.json")


def version_uri(registry_uri: str, pipeline: str, number: int) -> str:
    return gcs.join(registry_uri, pipeline, "versions", f"{number:04d}.json")


def versions(registry_uri: str, pipeline: str) -> dict[int, Any]:
    """Version number -> its object (a google-cloud-storage blob), for every version present."""
    uri = gcs.join(registry_uri, pipeline, "versions")
    bucket, base = gcs.split_uri(uri)
    found = {}
    for blob in gcs.client().list_blobs(bucket, prefix=base + "/"):
        match = _VERSION_NAME.fullmatch(blob.name[len(base) + 1 :])
        if match:
            found[int(match.group(1))] = blob
    return found


def refused(alias: str, problem: str, version: int | None = None, version_uri: str | None = None) -> ArtifactError:
    """The error for a champion that cannot be trusted: what is wrong, where, and what an operator does."""
    where = f"version {version} ({version_uri}): " if version is not None else ""
    return ArtifactError(
        f"the {CHAMPION} alias {alias} is refused: {where}{problem}. The gate trusts only a champion it can "
        f"verify: a version of this registry whose own run's committed {GATE_STAGE} promoted it, judging the "
        f"committed {EVALUATION_STAGE} of its model, a committed {MODEL_STAGE} under the artifact root; repair "
        "it (point the alias at a version as publish writes it) or delete it to compare with the base only (the "
        "next promotion writes it again)"
    )


def champion(registry_uri: str, pipeline: str, artifact_root: str) -> dict[str, Any] | None:
    """The champion's version entry, verified, or None when nothing was promoted yet.

    Returned: the entry with ``version``, ``version_uri`` and ``alias_uri``, and what was verified:
    ``gate_manifest`` (the committed gate of the version's own run of ``pipeline``, which promoted it),
    ``evaluation_manifest`` and ``eval_set_fingerprint`` (the committed evaluate_tuned that gate judged),
    ``model_manifest`` and ``model_fingerprint`` (the committed merge_adapter that evaluation evaluated:
    the version's model, with the fingerprint the version records). Anything else raises ArtifactError
    naming the alias, the version and the problem: a champion from elsewhere would decide what the gate
    promotes. Every object is read with a byte cap.
    """
    where = alias_uri(registry_uri, pipeline)
    alias = _read(where, ALIAS_MAX_BYTES, lambda problem: refused(where, f"it {problem}"))
    if alias is None:
        return None
    number = alias.get("version")
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise refused(where, f"its version is {_short(number)}, not a version number")
    expected = version_uri(registry_uri, pipeline, number)
    if alias.get("version_uri", expected) != expected:
        raise refused(where, f"it points at {_short(alias['version_uri'])}, not at this registry's {expected}")

    def wrong(problem: str) -> ArtifactError:
        return refused(where, problem, number, expected)

    entry = _read(expected, VERSION_MAX_BYTES, wrong)
    if entry is None:
        raise refused(where, f"it points at {expected}, which does not exist")
    return {**verified(entry, number, expected, pipeline, artifact_root, wrong, alias), "alias_uri": where}


def verified(
    entry: dict[str, Any],
    number: int,
    uri: str,
    pipeline: str,
    artifact_root: str,
    wrong: Callable[[str], Exception],
    alias: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Version ``number``'s ``entry`` (read from ``uri``) with what was verified of it, as ``champion``
    describes; ``wrong(problem)`` is raised otherwise. ``alias``: the alias that names it, whose model
    must be the version's."""
    if entry.get("version", number) != number:
        raise wrong(f"{uri} does not hold version {number}")
    model = _model(entry, alias or {}, artifact_root, wrong)
    gate = _gate(entry, artifact_root, pipeline, wrong)
    evaluation = _evaluation(gate, model, artifact_root, wrong)
    eval_set = _mapping(_mapping(evaluation.data.get("inputs")).get("eval_set")).get("fingerprint")
    return {
        **entry,
        "version": number,
        "version_uri": uri,
        "gate_manifest": gate.uri,
        "evaluation_manifest": evaluation.uri,
        "eval_set_fingerprint": eval_set if isinstance(eval_set, str) else None,
        "model_manifest": model.uri,
        "model_fingerprint": model.fingerprint,
    }


def _read(uri: str, max_bytes: int, wrong: Any) -> dict[str, Any] | None:
    try:
        return artifacts.read_json_object(uri, max_bytes=max_bytes)
    except artifacts.JsonObjectError as exc:
        raise wrong(exc.problem) from None


def _commit(
    uri: Any, artifact_root: str, stage: str, what: str, wrong: Any, pipeline: str | None = None
) -> artifacts.Manifest:
    """The committed manifest of ``stage`` (of ``pipeline``, when given) at ``uri``; ``wrong(problem)`` otherwise."""
    problem = artifacts.stage_manifest_problem(uri, artifact_root, stage, pipeline)
    if problem:
        raise wrong(f"its {what} {_short(uri)} is refused: {problem}")
    try:
        manifest = artifacts.read_manifest(str(uri))
    except (ArtifactError, ValueError) as exc:
        raise wrong(f"its {what} {uri} does not exist or is not whole: {exc}") from None
    recorded = manifest.data.get("stage")
    if recorded != stage:
        raise wrong(f"its {what} {uri} is a manifest of stage {_short(recorded)}, not of {stage}")
    return manifest


def _model(entry: dict[str, Any], alias: dict[str, Any], artifact_root: str, wrong: Any) -> artifacts.Manifest:
    pointer = entry.get("model_manifest")
    named = alias.get("model_manifest", pointer)
    if named != pointer:
        problem = artifacts.stage_manifest_problem(named, artifact_root, MODEL_STAGE)
        raise wrong(
            f"the alias's model {_short(named)} is refused: {problem}"
            if problem
            else f"the alias names the model {_short(named)}, the version {_short(pointer)}"
        )
    model = _commit(pointer, artifact_root, MODEL_STAGE, "model", wrong)
    recorded = entry.get("model_fingerprint")
    if recorded is not None and recorded != model.fingerprint:
        raise wrong(f"its model's files have fingerprint {model.fingerprint}, the version records {_short(recorded)}")
    return model


def _gate(entry: dict[str, Any], artifact_root: str, pipeline: str, wrong: Any) -> artifacts.Manifest:
    """The committed gate of the version's own run of ``pipeline``, which promoted it."""
    run = entry.get("run_id")
    try:
        own = gcs.join(artifact_root, pipeline, artifacts.safe_run_id(run if isinstance(run, str) else "")) + "/"
    except ArtifactError:
        raise wrong(f"it names no run of {pipeline} (run_id {_short(run)})") from None
    pointer = entry.get("gate_manifest") or own + f"{GATE_STAGE}/{artifacts.MANIFEST}"
    if isinstance(pointer, str) and not pointer.startswith(own):
        raise wrong(f"its gate {_short(pointer)} is not a commit of its own run {own}")
    gate = _commit(pointer, artifact_root, GATE_STAGE, "run's gate", wrong, pipeline)
    try:
        promoted = GateSummary.from_object(
            gate.data.get("summary"), f"the summary of its run's gate {gate.uri}"
        ).promote
    except SummaryError as exc:
        raise wrong(f"{exc.uri} {exc.problem}") from None
    if not promoted:
        raise wrong(f"its run's gate {gate.uri} did not promote it")
    return gate


def _evaluation(
    gate: artifacts.Manifest, model: artifacts.Manifest, artifact_root: str, wrong: Any
) -> artifacts.Manifest:
    """The committed evaluate_tuned the gate judged, which must be of ``model``."""
    pointer = _mapping(_mapping(gate.data.get("inputs")).get("tuned_eval")).get("uri")
    evaluation = _commit(pointer, artifact_root, EVALUATION_STAGE, "evaluation (its run's gate's tuned_eval)", wrong)
    used = _mapping(_mapping(evaluation.data.get("inputs")).get("model"))
    if used.get("uri") != model.uri or used.get("fingerprint") != model.fingerprint:
        raise wrong(
            f"its run's gate {gate.uri} judged an evaluation of the model {_short(used.get('uri'))} (fingerprint "
            f"{_short(used.get('fingerprint'))}), not of its model {model.uri} ({model.fingerprint})"
        )
    return evaluation


def recorded_metric(entry: dict[str, Any], metric: str) -> float | None:
    """The eval ``metric`` a registry version records for its model (publish writes ``metrics``), when it
    is a finite number; else None. What the entry says only: the gate measures the champion's figure
    from its committed evaluation and notes where this differs."""
    metrics = _mapping(entry.get("metrics"))
    if metrics.get(metric) is not None:
        return _finite(metrics[metric])
    decision = _mapping(entry.get("decision"))  # versions registered before ``metrics`` was recorded
    if decision.get("metric") == metric and decision.get("tuned") is not None:
        return _finite(decision["tuned"])
    return _finite(_mapping(decision.get("tuned_metrics")).get(metric))


def recorded_value(entry: dict[str, Any], metric: str) -> Any:
    """What the version records for ``metric``, whatever it is (for a note), or None."""
    metrics = _mapping(entry.get("metrics"))
    return metrics[metric] if metric in metrics else recorded_metric(entry, metric)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


#: The most characters ``shown`` prints of one field (a reason is at most 1000; a bucket writer's field
#: may be 64 kB).
SHOWN_MAX_CHARS = 1200


def shown(value: Any, *, quoted: bool = False) -> str:
    """A field read from the registry (a version, the alias, an audit event) as a listing or a message
    prints it, on one line: printable text as it is (``quoted``: in double quotes); other text in double
    quotes with every character that is not printable escaped as Python writes it (``\\n``, ``\\x1b``,
    ``\\u202e``; ``\\`` and ``\\"`` too), so a line break, a terminal escape code or a bidi override written
    into the bucket never reaches the reader's terminal; anything but text as Python's ``repr`` (which
    escapes the same way). Cut to ``SHOWN_MAX_CHARS``."""
    if not isinstance(value, str):
        text = repr(value)
    elif value.isprintable() and "\\" not in value and not quoted:
        text = value
    else:
        text = '"' + "".join(_escaped(ch) for ch in value) + '"'
    return text if len(text) <= SHOWN_MAX_CHARS else text[: SHOWN_MAX_CHARS - 3] + "..."


def _escaped(ch: str) -> str:
    if ch in '\\"':
        return "\\" + ch
    return ch if ch.isprintable() else repr(ch)[1:-1]


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters: a bucket writer's value goes into messages only so."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
