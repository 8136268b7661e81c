"""Reading a pipeline's model registry in GCS (written by ``loraflow.steps.publish``).

Layout under ``{registry_uri}/{pipeline}/``: ``versions/NNNN.json`` (one per promoted model,
never overwritten) and ``aliases/champion.json`` (points at the current champion's version).
"""

from __future__ import annotations

from typing import Any

from loraflow.errors import ArtifactError
from loraflow.pipeline import artifacts, gcs

CHAMPION = "champion"


def alias_uri(registry_uri: str, pipeline: str, alias: str = CHAMPION) -> str:
    return gcs.join(registry_uri, pipeline, "aliases", f"{alias}.json")


def version_uri(registry_uri: str, pipeline: str, number: int) -> str:
    return gcs.join(registry_uri, pipeline, "versions", f"{number:04d}.json")


def champion(registry_uri: str, pipeline: str, artifact_root: str | None = None) -> dict[str, Any] | None:
    """The champion's version entry (with ``version_uri``), or None when nothing was promoted yet.

    The alias may only point at a version of this registry (``versions/NNNN.json`` under
    ``{registry_uri}/{pipeline}``), and that version's model only at a ``merge_adapter`` commit under
    ``artifact_root`` (when given). Anything else is refused, never read: a champion from elsewhere
    would decide what the gate promotes.
    """
    where = alias_uri(registry_uri, pipeline)
    alias = artifacts.read_json(where)
    if alias is None:
        return None
    number = alias.get("version") if isinstance(alias, dict) else None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise _refused(where, f"its version is {number!r}, not a version number")
    expected = version_uri(registry_uri, pipeline, number)
    if alias.get("version_uri", expected) != expected:
        raise _refused(where, f"it points at {alias['version_uri']!r}, not at this registry's {expected}")
    entry = artifacts.read_json(expected)
    if entry is None:
        raise ArtifactError(
            f"the {CHAMPION} alias of {pipeline} points at {expected}, which does not exist; "
            f"repair the registry (point {where} at an existing version)"
        )
    if not isinstance(entry, dict) or entry.get("version", number) != number:
        raise _refused(where, f"{expected} does not hold version {number}")
    if artifact_root is not None:
        for pointer in {entry.get("model_manifest"), alias.get("model_manifest", entry.get("model_manifest"))}:
            problem = artifacts.stage_manifest_problem(pointer, artifact_root, "merge_adapter")
            if problem:
                raise _refused(where, f"its model {pointer!r} is refused: {problem}")
    return {**entry, "version_uri": expected}


def _refused(alias: str, problem: str) -> ArtifactError:
    return ArtifactError(
        f"the {CHAMPION} alias {alias} is refused: {problem}. An alias may only point at a version of its "
        "own registry whose model is a merge_adapter commit under the artifact root; repair it (point it at "
        "an existing version, as publish writes it) or delete it to compare with the base only"
    )


def recorded_metric(entry: dict[str, Any], metric: str) -> float | None:
    """The eval ``metric`` a registry version recorded for its model (publish writes ``metrics``)."""
    metrics = entry.get("metrics") or {}
    if metric in metrics and metrics[metric] is not None:
        return float(metrics[metric])
    decision = entry.get("decision") or {}  # versions registered before ``metrics`` was recorded
    if decision.get("metric") == metric and decision.get("tuned") is not None:
        return float(decision["tuned"])
    tuned = decision.get("tuned_metrics") or {}
    return float(tuned[metric]) if tuned.get(metric) is not None else None
