"""The "adapter did nothing" guards and the gate's comparison with the registry's champion.

The merge guard runs the real merge_adapter step on a two-tensor checkpoint written with
loraflow's own safetensors writer (the control environment has numpy, not the safetensors
package). The champion tests keep a constructed registry in the GCS emulator.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.lora.safetensors_io import ShardedWriter, TensorSpec
from loraflow.registry import store as registry
from loraflow.steps import gate, merge_adapter, publish
from loraflow.storage import artifacts, gcs

from .champions import Champion, commit_dir, committed_gate, register_champion, upstream
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


@pytest.fixture
def register(gcs_bucket: str, tmp_path: Path) -> Callable[..., Champion]:
    """A champion as a real run and publish leave it: its model, its evaluation (``accuracy`` right), its
    registry version and the alias."""

    def make(version: int, accuracy: float, **changes) -> Champion:  # type: ignore[no-untyped-def]
        return register_champion(
            f"{gcs_bucket}/_registry", f"{gcs_bucket}/artifacts", tmp_path, accuracy=accuracy,
            run=f"run-{version}", version=version, **changes,
        )  # fmt: skip

    return make


@pytest.fixture
def gate_run(tmp_path: Path, make_ctx: Callable, gcs_bucket: str) -> Callable:
    """gate.run on base 0.20 -> tuned (0.95 unless given; a clear gain over the base) with a registry config."""

    def run(model_fingerprint: str = "fp-new", tuned: str = "1" * 95 + "0" * 5) -> tuple[dict, dict]:
        shutil.rmtree(tmp_path / "evals", ignore_errors=True)
        inputs = {
            "base_eval": write_eval(tmp_path / "evals" / "b", "0" * 80 + "1" * 20),
            "tuned_eval": write_eval(tmp_path / "evals" / "t", tuned),
        }
        tuned_manifest = artifacts.Manifest(
            "gs://x/tiny/run-9/evaluate_tuned/_MANIFEST.json",
            {"inputs": {"model": {"fingerprint": model_fingerprint}, "eval_set": {"fingerprint": "eval-fp"}}},
        )
        config = {"min_improvement": 0.3, "registry_uri": f"{gcs_bucket}/_registry", "pipeline": "tiny",
                  "artifact_root": f"{gcs_bucket}/artifacts"}  # fmt: skip
        ctx = make_ctx("gate", inputs, config, {"tuned_eval": tuned_manifest})
        summary = gate.run(ctx)
        return summary, json.loads((ctx.out / "decision.json").read_text())

    return run


def test_without_a_champion_the_base_comparison_decides(gate_run: Callable) -> None:
    summary, decision = gate_run()
    assert summary["promote"] is True and summary["champion_version"] is None
    assert decision["champion"] is None and decision["tuned_model_fingerprint"] == "fp-new"


def test_a_better_champion_blocks_promotion(gate_run: Callable, register: Callable) -> None:
    register(3, accuracy=0.97)
    summary, decision = gate_run()
    assert summary["promote"] is False and summary["champion_version"] == 3
    assert "does not beat the champion (version 3, run run-3): 0.970" in summary["reason"]
    assert decision["champion"]["value"] == pytest.approx(0.97) and decision["champion"]["beaten"] is False


def test_a_tie_with_the_champion_is_not_a_win(gate_run: Callable, register: Callable) -> None:
    register(1, accuracy=0.95)
    summary, _ = gate_run()
    assert summary["promote"] is False


def test_beating_the_champion_promotes_and_says_against_whom(gate_run: Callable, register: Callable) -> None:
    register(2, accuracy=0.5)
    summary, decision = gate_run()
    assert summary["promote"] is True
    assert "beats the champion (version 2" in summary["reason"]
    assert decision["champion"]["version"] == 2 and decision["champion"]["beaten"] is True


def test_the_champion_itself_is_never_promoted_again(gate_run: Callable, register: Callable) -> None:
    champ = register(1, accuracy=0.5)
    summary, decision = gate_run(model_fingerprint=champ.model.fingerprint)
    assert summary["promote"] is False
    assert "is the champion (version 1, run run-1) itself" in decision["reason"]


def test_the_champion_moving_changes_the_decision(gate_run: Callable, register: Callable) -> None:
    """Same inputs, same config: only the registry moved. The gate is therefore not cached."""
    register(1, accuracy=0.5)
    assert gate_run()[0]["promote"] is True
    register(2, accuracy=0.99)
    assert gate_run()[0]["promote"] is False


@pytest.mark.parametrize("recorded", [-1, float("-inf"), float("nan"), "abc", 0.1, None, [0.1]])
def test_the_champions_figure_is_measured_from_its_own_evaluation_not_taken_from_its_version(
    gate_run: Callable, register: Callable, recorded: object
) -> None:
    """A bucket writer's -1 let a 0.50 model replace a 0.95 champion; "abc" crashed the gate unnamed."""
    register(1, accuracy=0.95, entry={"metrics": {"accuracy": recorded}})
    summary, decision = gate_run(tuned="1" * 50 + "0" * 50)  # 0.20 -> 0.50: clears the base comparison
    assert summary["promote"] is False and summary["champion_version"] == 1
    assert "does not beat the champion (version 1, run run-1): 0.950" in summary["reason"]
    assert decision["champion"]["value"] == pytest.approx(0.95)
    assert decision["champion"]["evaluation_manifest"].endswith("/tiny/run-1/evaluate_tuned/_MANIFEST.json")
    assert decision["champion"]["gate_manifest"].endswith("/tiny/run-1/gate/_MANIFEST.json")
    assert any(f"records accuracy {recorded!r}" in n and "measured from" in n for n in decision["notes"]), decision


def test_a_champion_whose_evaluation_was_changed_fails_the_gate_naming_the_file_and_version(
    gate_run: Callable, register: Callable
) -> None:
    champ = register(1, accuracy=0.5)
    bucket, path = gcs.split_uri(champ.evaluation.prefix)
    gcs.client().bucket(bucket).blob(f"{path}/predictions.parquet").upload_from_string(b"forged")
    with pytest.raises(ArtifactError, match=r"predictions\.parquet") as err:
        gate_run()
    assert f"version 1 ({champ.version_uri})" in str(err.value) and "repair it" in str(err.value)


def test_a_champion_evaluated_without_the_gates_metric_cannot_be_beaten_and_says_so(
    gate_run: Callable, register: Callable, gcs_bucket: str, tmp_path: Path
) -> None:
    """A champion measured before the spec gated on this metric: no figure to beat, so no promotion."""
    import pandas as pd

    champ = register(1, accuracy=0.5)
    local = write_eval(tmp_path / "old-eval", "1" * 50 + "0" * 50)
    pd.read_parquet(local / "predictions.parquet").drop(columns=["correct"]).to_parquet(local / "predictions.parquet")
    root = f"{gcs_bucket}/artifacts"
    old = commit_dir(local, f"{root}/tiny/run-0/evaluate_tuned", "evaluate_tuned", {"model": upstream(champ.model)})
    committed_gate(root, "tiny", "run-0", old.uri, tmp_path)
    artifacts.write_json(champ.version_uri, {**champ.entry, "run_id": "run-0", "gate_manifest": None})
    summary, decision = gate_run()
    assert summary["promote"] is False
    assert "has no per-example 'correct' column, so it cannot be compared" in summary["reason"]
    assert decision["champion"]["value"] is None


def test_the_gate_planned_from_the_spec_compares_with_the_champion_under_its_artifact_root(
    parity_spec, tmp_path: Path, make_ctx: Callable
) -> None:
    """GateConfig.from_spec hands the gate the spec's artifact_root: without it the gate refuses to read the
    champion, with another root it refuses the champion (its model lies outside)."""
    from loraflow.pipeline.plan import stage_plans

    config = stage_plans(parity_spec)["gate"].config
    register_champion(parity_spec.registry_uri, parity_spec.artifact_root, tmp_path, pipeline=parity_spec.name,
                      accuracy=0.97)  # fmt: skip
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5),
    }
    summary = gate.run(make_ctx("gate", inputs, config))
    assert summary["champion_version"] == 1 and summary["promote"] is False
    assert "does not beat the champion (version 1, run run-1): 0.970" in summary["reason"]
    with pytest.raises(LoraflowError, match="artifact_root"):
        gate.run(make_ctx("gate", inputs, {**config, "artifact_root": None}))


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
