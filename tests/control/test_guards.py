"""The "adapter did nothing" guards and the gate's comparison with the registry's champion.

The merge guard runs the real merge_adapter step on a two-tensor checkpoint written with
loraflow's own safetensors writer (the control environment has numpy, not the safetensors
package). The champion tests keep a constructed registry in the GCS emulator.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from loraflow.lora.safetensors_io import ShardedWriter, TensorSpec
from loraflow.pipeline import artifacts, gcs
from loraflow.registry import store as registry
from loraflow.steps import gate, merge_adapter, publish

from .test_gate import write_eval

# ------------------------------------------------------------------------------ merge_adapter


def save(path: Path, tensors: dict[str, np.ndarray]) -> None:
    specs = [TensorSpec(k, "F32", tuple(v.shape)) for k, v in tensors.items()]
    with ShardedWriter(path, specs, 1 << 30) as w:
        for k, v in tensors.items():
            w.write(k, v.astype(np.float32))


@pytest.fixture
def tiny_base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    rng = np.random.default_rng(0)
    save(base, {"model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)), "model.norm.weight": np.ones(8)})
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return base


def adapter(root: Path, b_scale: float) -> Path:
    rng = np.random.default_rng(1)
    peft = root / "peft"
    save(
        peft,
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((2, 8)) * 0.1,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal((8, 2)) * b_scale,
        },
    )
    (peft / "model.safetensors").rename(peft / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (peft / "adapter_config.json").write_text(json.dumps(config))
    return root


def test_merge_of_a_trained_adapter_passes(tiny_base: Path, tmp_path: Path, make_ctx: Callable) -> None:
    ctx = make_ctx("merge_adapter", {"base": tiny_base, "adapter": adapter(tmp_path / "a", 0.5)})
    summary = merge_adapter.run(ctx)
    assert summary["merged"] == 1 and summary["changed"] == 1


def test_merge_of_a_zero_adapter_fails_loudly(tiny_base: Path, tmp_path: Path, make_ctx: Callable) -> None:
    ctx = make_ctx("merge_adapter", {"base": tiny_base, "adapter": adapter(tmp_path / "a", 0.0)})
    with pytest.raises(merge_adapter.NoOpMergeError) as err:
        merge_adapter.run(ctx)
    message = str(err.value)
    assert "merged weights equal the base" in message and "did nothing" in message
    for hint in ("learning rate", "training.steps", "lora.target_modules"):
        assert hint in message


# ------------------------------------------------------------------------------ gate: no-op


def test_identical_generations_fail_the_gate(tmp_path: Path, make_ctx: Callable) -> None:
    pattern = "01" * 50
    inputs = {"base_eval": write_eval(tmp_path / "b", pattern), "tuned_eval": write_eval(tmp_path / "t", pattern)}
    ctx = make_ctx("gate", inputs, {})
    with pytest.raises(gate.NoOpAdapterError) as err:
        gate.run(ctx)
    message = str(err.value)
    assert "adapter did nothing" in message and "all 100 eval examples" in message
    assert "training.learning_rate" in message and "lora.target_modules" in message
    assert not (ctx.out / "decision.json").exists()  # nothing to promote from


def test_one_different_generation_is_not_a_no_op(tmp_path: Path, make_ctx: Callable) -> None:
    pattern = "01" * 50
    gens = ["even" if c == "1" else "odd" for c in pattern]
    inputs = {
        "base_eval": write_eval(tmp_path / "b", pattern),
        "tuned_eval": write_eval(tmp_path / "t", pattern, [*gens[:-1], "even!"]),
    }
    ctx = make_ctx("gate", inputs, {})
    assert gate.run(ctx)["promote"] is False  # not better, but not a no-op: the step succeeds
    assert json.loads((ctx.out / "decision.json").read_text())["identical_generations"] == 99


# ------------------------------------------------------------------------------ gate: champion


def register(registry_uri: str, pipeline: str, version: int, accuracy: float, fingerprint: str = "fp-old") -> None:
    """A registry version + champion alias as publish writes them."""
    entry = {
        "format": publish.VERSION_FORMAT,
        "pipeline": pipeline,
        "version": version,
        "run_id": f"run-{version}",
        "model_manifest": f"gs://x/{pipeline}/run-{version}/merge_adapter/_MANIFEST.json",
        "model_fingerprint": fingerprint,
        "metrics": {"accuracy": accuracy, "n": 100},
    }
    version_uri = gcs.join(registry_uri, pipeline, "versions", f"{version:04d}.json")
    artifacts.write_json(version_uri, entry)
    artifacts.write_json(
        registry.alias_uri(registry_uri, pipeline),
        {"alias": "champion", "version": version, "version_uri": version_uri, "run_id": entry["run_id"]},
    )


@pytest.fixture
def gate_run(tmp_path: Path, make_ctx: Callable, gcs_bucket: str) -> Callable:
    """gate.run on base 0.20 -> tuned 0.95 (a clear gain over the base) with a registry config."""

    evals = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5),
    }

    def run(model_fingerprint: str = "fp-new") -> tuple[dict, dict]:
        inputs = dict(evals)
        tuned_manifest = artifacts.Manifest(
            "gs://x/tiny/run-9/evaluate_tuned/_MANIFEST.json",
            {"inputs": {"model": {"fingerprint": model_fingerprint}, "eval_set": {"fingerprint": "eval-fp"}}},
        )
        config = {"min_improvement": 0.3, "registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny"}
        ctx = make_ctx("gate", inputs, config, {"tuned_eval": tuned_manifest})
        summary = gate.run(ctx)
        return summary, json.loads((ctx.out / "decision.json").read_text())

    return run


def test_without_a_champion_the_base_comparison_decides(gate_run: Callable) -> None:
    summary, decision = gate_run()
    assert summary["promote"] is True and summary["champion_version"] is None
    assert decision["champion"] is None and decision["tuned_model_fingerprint"] == "fp-new"


def test_a_better_champion_blocks_promotion(gate_run: Callable, gcs_bucket: str) -> None:
    register(f"{gcs_bucket}/_registry", "tiny", 3, accuracy=0.97)
    summary, decision = gate_run()
    assert summary["promote"] is False and summary["champion_version"] == 3
    assert "does not beat the champion (version 3, run run-3): 0.970" in summary["reason"]
    assert decision["champion"]["value"] == pytest.approx(0.97) and decision["champion"]["beaten"] is False


def test_a_tie_with_the_champion_is_not_a_win(gate_run: Callable, gcs_bucket: str) -> None:
    register(f"{gcs_bucket}/_registry", "tiny", 1, accuracy=0.95)
    summary, _ = gate_run()
    assert summary["promote"] is False


def test_beating_the_champion_promotes_and_says_against_whom(gate_run: Callable, gcs_bucket: str) -> None:
    register(f"{gcs_bucket}/_registry", "tiny", 2, accuracy=0.5)
    summary, decision = gate_run()
    assert summary["promote"] is True
    assert "beats the champion (version 2" in summary["reason"]
    assert decision["champion"]["version"] == 2 and decision["champion"]["beaten"] is True


def test_the_champion_itself_is_never_promoted_again(gate_run: Callable, gcs_bucket: str) -> None:
    register(f"{gcs_bucket}/_registry", "tiny", 1, accuracy=0.5, fingerprint="same-model")
    summary, decision = gate_run(model_fingerprint="same-model")
    assert summary["promote"] is False
    assert "is the champion (version 1, run run-1) itself" in decision["reason"]


def test_the_champion_moving_changes_the_decision(gate_run: Callable, gcs_bucket: str) -> None:
    """Same inputs, same config: only the registry moved. The gate is therefore not cached."""
    register(f"{gcs_bucket}/_registry", "tiny", 1, accuracy=0.5)
    assert gate_run()[0]["promote"] is True
    register(f"{gcs_bucket}/_registry", "tiny", 2, accuracy=0.99)
    assert gate_run()[0]["promote"] is False


def test_gate_config_needs_registry_and_pipeline_together() -> None:
    with pytest.raises(Exception, match="registry_uri and pipeline together"):
        gate.resolve_config({"registry_uri": "gs://b/_registry"})


def test_publish_records_the_tuned_metrics_for_the_next_gate() -> None:
    decision = {"metric": "accuracy", "tuned": 0.95, "tuned_metrics": {"accuracy": 0.95, "n": 100, "correct": [1]}}
    metrics = publish.eval_metrics(decision)
    assert metrics == {"accuracy": 0.95, "n": 100}
    assert registry.recorded_metric({"metrics": metrics}, "accuracy") == 0.95
    # versions registered before metrics were recorded: read from their decision
    assert registry.recorded_metric({"decision": decision}, "accuracy") == 0.95
    assert registry.recorded_metric({}, "accuracy") is None
