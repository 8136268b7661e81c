"""A pipeline's champion as a real run leaves it in GCS, for the gate's and the registry's tests.

``register_champion`` commits a merge_adapter model, the evaluate_tuned evaluation of that model
(predictions.parquet and metrics.json, as the evaluate step writes them) and the gate that judged it,
under ``{root}/{pipeline}/{run}/``, then a registry version and the champion alias as publish writes
them. Keyword arguments change one piece at a time, so a test can forge exactly one thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.pipeline import artifacts, gcs
from loraflow.registry import store as registry
from loraflow.steps import publish

from .test_gate import write_eval


def commit_dir(local: Path, prefix: str, stage: str, inputs: dict[str, Any]) -> artifacts.Manifest:
    files = artifacts.upload_tree(local, prefix)
    return artifacts.commit(
        prefix, files, stage=stage, inputs=inputs, config={}, lock_version="t", cache_key="", summary={}
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


@dataclass(frozen=True)
class Champion:
    model: artifacts.Manifest
    evaluation: artifacts.Manifest
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
) -> Champion:
    """Commit a model, its evaluation (``accuracy`` right) and its gate; register them as ``version``
    with the alias on it. ``entry`` and ``alias`` replace fields of what publish would write."""
    model = committed_model(root, pipeline, run, tmp_path, payload=f"{run}-{version}".encode())
    evaluation = committed_evaluation(root, pipeline, run, model, accuracy_pattern(accuracy), tmp_path)
    gate_dir = tmp_path / f"gate-{pipeline}-{run}-{version}"
    gate_dir.mkdir(parents=True)
    (gate_dir / "decision.json").write_text("{}")
    inputs = {"tuned_eval": upstream(evaluation), "base_eval": {"uri": "gs://b/base", "fingerprint": "b"}}
    commit_dir(gate_dir, gcs.join(root, pipeline, run, "gate"), "gate", inputs)
    body = {
        "format": publish.VERSION_FORMAT,
        "pipeline": pipeline,
        "version": version,
        "run_id": run,
        "model_manifest": model.uri,
        "model_fingerprint": model.fingerprint,
        "evaluation_manifest": evaluation.uri,
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
    return Champion(model, evaluation, version_uri, body)
