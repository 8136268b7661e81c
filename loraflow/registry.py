"""Reading a pipeline's model registry in GCS (written by ``loraflow.steps.publish``).

Layout under ``{registry_uri}/{pipeline}/``: ``versions/NNNN.json`` (one per promoted model,
never overwritten) and ``aliases/champion.json`` (points at the current champion's version).
"""

from __future__ import annotations

from typing import Any

from loraflow import artifacts, gcs
from loraflow.errors import ArtifactError

CHAMPION = "champion"


def alias_uri(registry_uri: str, pipeline: str, alias: str = CHAMPION) -> str:
    return gcs.join(registry_uri, pipeline, "aliases", f"{alias}.json")


def champion(registry_uri: str, pipeline: str) -> dict[str, Any] | None:
    """The champion's version entry (with ``version_uri``), or None when nothing was promoted yet."""
    alias = artifacts.read_json(alias_uri(registry_uri, pipeline))
    if alias is None:
        return None
    version_uri = alias.get("version_uri") or gcs.join(
        registry_uri, pipeline, "versions", f"{alias['version']:04d}.json"
    )
    entry = artifacts.read_json(version_uri)
    if entry is None:
        raise ArtifactError(
            f"the {CHAMPION} alias of {pipeline} points at {version_uri}, which does not exist; "
            f"repair the registry (point {alias_uri(registry_uri, pipeline)} at an existing version)"
        )
    return {**entry, "version_uri": version_uri}


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
