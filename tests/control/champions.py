"""A pipeline's champion as a real run leaves it in GCS, for the gate's and the registry's tests.

``register_champion`` commits a merge_adapter model, the evaluate_tuned evaluation of that model
(predictions.parquet and metrics.json, as the evaluate step writes them) and the gate that judged it
and promoted, under ``{root}/{pipeline}/{run}/``, then a registry version and the champion alias as
publish writes them. Keyword arguments change one piece at a time, so a test can forge exactly one thing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.registry import store as registry
from loraflow.steps import publish
from loraflow.storage import artifacts, gcs

from .test_gate import write_eval


def commit_dir(
    local: Path, prefix: str, stage: str, inputs: dict[str, Any], summary: dict[str, Any] | None = None
) -> artifacts.Manifest:
    files = artifacts.upload_tree(local, prefix)
    return artifacts.commit(
        prefix, files, stage=stage, inputs=inputs, config={}, lock_version="t", cache_key="", summary=summary or {}
    )


def upstream(manifest: artifacts.Manifest) -> dict[str, str]:
    """How a downstream manifest records ``manifest`` as its input (the step harness's record)."""
    return {"uri": manifest.uri, "fingerprint": manifest.fingerprint}


def committed_model(
    root: str, pipeline: str, run: str, tmp_path: Path, payload: bytes = b"weights"
) -> artifacts.Manifest:
    local = tmp_path / f"model-{pipeline}-{run}-{abs(hash(payload))}"
    local.mkdir(parents=True)
    (local / "model.safetensors").write_bytes(payload)
    return commit_dir(local, gcs.join(root, pipeline, run, "merge_adapter"), "merge_adapter", {})


def committed_evaluation(
    root: str, pipeline: str, run: str, model: artifacts.Manifest, pattern: str, tmp_path: Path
) -> artifacts.Manifest:
    """evaluate_tuned of ``model``: one example per character of ``pattern`` ('1' answered right)."""
    local = write_eval(tmp_path / f"eval-{pipeline}-{run}-{model.fingerprint[:8]}", pattern)
    inputs = {"model": upstream(model), "eval_set": {"uri": "gs://b/eval", "fingerprint": "eval-fp"}}
    return commit_dir(local, gcs.join(root, pipeline, run, "evaluate_tuned"), "evaluate_tuned", inputs)


def committed_gate(
    root: str, pipeline: str, run: str, tuned_eval: str, tmp_path: Path, promote: bool = True
) -> artifacts.Manifest:
    """The gate commit of ``run``: it judged the evaluate_tuned ``tuned_eval`` and promoted (or not)."""
    local = tmp_path / f"gate-{pipeline}-{run}"
    local.mkdir(parents=True)
    (local / "decision.json").write_text(json.dumps({"promote": promote}))
    inputs = {
        "tuned_eval": {"uri": tuned_eval, "fingerprint": "t"},
        "base_eval": {"uri": "gs://b/b", "fingerprint": "b"},
    }
    return commit_dir(local, gcs.join(root, pipeline, run, "gate"), "gate", inputs, {"promote": promote})


@dataclass(frozen=True)
class Champion:
    model: artifacts.Manifest
    evaluation: artifacts.Manifest
    gate: artifacts.Manifest
    version_uri: str
    entry: dict[str, Any]


def accuracy_pattern(accuracy: float, n: int = 100) -> str:
    right = round(accuracy * n)
    return "1" * right + "0" * (n - right)


def register_champion(
    registry_uri: str,
    root: str,
    tmp_path: Path,
    *,
    accuracy: float = 0.95,
    pipeline: str = "tiny",
    run: str = "run-1",
    version: int = 1,
    entry: dict[str, Any] | None = None,
    alias: dict[str, Any] | None = None,
    model_at: tuple[str, str] | None = None,
) -> Champion:
    """Commit a model, its evaluation (``accuracy`` right) and the gate of ``run`` that judged it and
    promoted; register them as ``version`` with the alias on it. ``model_at``: (pipeline, run) where the
    model and its evaluation were committed (a cache hit: another run's or pipeline's commit). ``entry``
    and ``alias`` replace fields of what publish would write."""
    where = model_at or (pipeline, run)
    model = committed_model(root, *where, tmp_path, payload=f"{run}-{version}".encode())
    evaluation = committed_evaluation(root, *where, model, accuracy_pattern(accuracy), tmp_path)
    gate = committed_gate(root, pipeline, run, evaluation.uri, tmp_path)
    body = {
        "format": publish.VERSION_FORMAT,
        "pipeline": pipeline,
        "version": version,
        "run_id": run,
        "model_manifest": model.uri,
        "model_fingerprint": model.fingerprint,
        "gate_manifest": gate.uri,
        "metrics": {"accuracy": accuracy, "n": 100},
        "eval_set_fingerprint": "eval-fp",
        **(entry or {}),
    }
    version_uri = registry.version_uri(registry_uri, pipeline, version)
    artifacts.write_json(version_uri, body)
    pointer = {
        "format": publish.ALIAS_FORMAT,
        "alias": "champion",
        "version": version,
        "version_uri": version_uri,
        "model_manifest": body["model_manifest"],
        "model_fingerprint": body["model_fingerprint"],
        "run_id": run,
        **(alias or {}),
    }
    artifacts.write_json(registry.alias_uri(registry_uri, pipeline), pointer)
    return Champion(model, evaluation, gate, version_uri, body)
