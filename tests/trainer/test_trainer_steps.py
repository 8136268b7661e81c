"""convert_checkpoint and lora_sft on the tiny model, with local directories (no GCS).

Checkpoint persistence goes to a local directory standing in for ``{output}/_checkpoints`` (the
step program treats a non-gs:// output_uri as a local root); the GCS path of the same code is for
the emulator fixture. ~3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).parent))  # llama_numpy

import pytest

pytest.importorskip("maxtext")

from loraflow.dev import tinymodel
from loraflow.steps._harness import StepContext
from tests.jax_cache import compiled_afresh
from tests.tensorboard_events import scalars

ROOT = Path(__file__).resolve().parents[2]
PARITY = ROOT / "pipelines" / "data" / "parity"
OVERRIDES = tinymodel.MAXTEXT_OVERRIDES
SFT = {
    "model_name": "llama3.1-8b",
    "model_overrides": OVERRIDES,
    "rank": 16,
    "alpha": 32,
    "target_modules": None,
    "steps": 150,
    "batch_size": 8,
    "learning_rate": 3e-3,
    "max_length": 64,
    "seed": 0,
    "checkpoint_period": 50,
    "dtype": "float32",
}


def _ctx(tmp: Path, stage: str, inputs: dict[str, Path], config: dict, output_uri: str) -> StepContext:
    out, work = tmp / "out", tmp / "work"
    out.mkdir(parents=True)
    work.mkdir(parents=True)
    return StepContext(stage, output_uri, inputs, {k: None for k in inputs}, out, work, config)


def _tiny_base(root: Path, family: str = "llama") -> dict:
    """The family's tiny model made, its chat dataset written, and the model converted for MaxText."""
    entry = tinymodel.tiny(family)
    hf = tinymodel.create(root / "hf", [PARITY / "train.jsonl"], family=family)
    ds = root / "dataset"
    ds.mkdir()
    for split in ("train", "eval"):  # as validate_data writes them
        with (PARITY / f"{split}.jsonl").open() as f, (ds / f"{split}.jsonl").open("w") as g:
            for line in f:
                r = json.loads(line)
                msgs = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
                g.write(json.dumps({"messages": msgs}) + "\n")

    from loraflow.steps import convert_checkpoint

    ctx = _ctx(
        root / "convert",
        "convert_checkpoint",
        {"hf_checkpoint": hf},
        {"model_name": entry.maxtext_model, "model_overrides": entry.maxtext_overrides, "scan_layers": True},
        "gs://b/p/r/convert_checkpoint",
    )
    summary = convert_checkpoint.run(ctx)
    return {"root": root, "hf": hf, "dataset": ds, "ckpt": ctx.out, "convert_summary": summary}


def test_convert_writes_a_scanned_orbax_checkpoint(base):
    import orbax.checkpoint as ocp

    meta = json.loads((base["ckpt"] / "loraflow_checkpoint.json").read_text())
    assert meta["load_parameters_path"] == "maxtext/0/items"
    assert meta["model_overrides"] == OVERRIDES and meta["scan_layers"] is True
    assert base["convert_summary"]["parameters"] == 426624  # the tiny Llama's parameter count
    tree = ocp.PyTreeCheckpointer().metadata(str(base["ckpt"] / "maxtext" / "0" / "items"))
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
    q = tree["params"]["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert tuple(q.shape) == (128, 2, 2, 64)  # (emb, layers scanned on axis 1, heads, head_dim)


def test_convert_holds_one_tensor_at_a_time_and_writes_the_hf_values(base, tmp_path, monkeypatch, capsys):
    """The conversion's memory is one tensor, not the model: every converted tensor is freed before the
    next is read. Chunked as the streamed writes chunk a large tensor (CHUNK_BYTES made small here, so
    the tiny model's tensors are split too), the values read back are the HF weights, bit for bit."""
    import weakref

    import orbax.checkpoint as ocp
    import tensorstore as ts
    from maxtext.checkpoint_conversion import to_maxtext
    from safetensors.numpy import load_file

    from loraflow.steps import convert_checkpoint
    from loraflow.trainer import streaming_save

    alive, most = [0], [0]
    original = to_maxtext.LazyTensor.__array__

    def counted(self, *a, **kw):
        array = original(self, *a, **kw)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(array, lambda: alive.__setitem__(0, alive[0] - 1))
        return array

    monkeypatch.setattr(to_maxtext.LazyTensor, "__array__", counted)
    monkeypatch.setattr(streaming_save, "CHUNK_BYTES", 16 << 10)
    config = {"model_name": "llama3.1-8b", "model_overrides": OVERRIDES, "scan_layers": True}
    ctx = _ctx(tmp_path, "convert_checkpoint", {"hf_checkpoint": base["hf"]}, config, "gs://b/p/r/convert_checkpoint")
    summary = convert_checkpoint.run(ctx)

    assert summary["parameters"] == 426624
    assert most[0] == 1, f"{most[0]} converted tensors were alive at once"
    wrote = [line for line in capsys.readouterr().out.splitlines() if "] wrote params." in line]
    assert len(wrote) == 12 and "12 of 12 tensors, 0.00 of 0.00 GiB in " in wrote[-1], wrote[-1:]

    items = ctx.out / "maxtext" / "0" / "items"
    restored = ocp.PyTreeCheckpointer().restore(str(items))["params"]["params"]
    hf = load_file(str(base["hf"] / "model.safetensors"))
    assert np_equal(restored["token_embedder"]["embedding"], hf["model.embed_tokens.weight"])
    wi_0 = restored["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]  # (emb, layers, mlp)
    for layer in range(2):
        assert np_equal(wi_0[:, layer, :], hf[f"model.layers.{layer}.mlp.gate_proj.weight"].T)
    stored = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {
                "driver": "ocdbt",
                "base": f"file://{items}",
                "path": "params.params.decoder.layers.mlp.wi_0.kernel",
            },
        }
    ).result()
    assert stored.chunk_layout.read_chunk.shape != tuple(wi_0.shape)  # chunked, and read back whole
    first = ocp.PyTreeCheckpointer().restore(str(base["ckpt"] / "maxtext" / "0" / "items"))["params"]["params"]
    import jax

    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np_equal, restored, first))


def np_equal(a, b) -> bool:
    import numpy as np

    return a.shape == b.shape and bool(np.array_equal(np.asarray(a), np.asarray(b).astype(np.asarray(a).dtype)))


@pytest.fixture(scope="module")
def trained(base):
    from loraflow.steps import lora_sft

    root = base["root"] / "sft1"
    inputs = {"checkpoint": base["ckpt"], "dataset": base["dataset"], "tokenizer": base["hf"]}
    ctx = _ctx(root, "lora_sft", inputs, dict(SFT), str(base["root"] / "remote" / "lora_sft"))
    lines: list[str] = []
    ctx.progress = lines.append  # type: ignore[method-assign]
    # compiled here, not read from the session's compilation cache: its first step's time is checked
    with pytest.MonkeyPatch.context() as mp, compiled_afresh(root / "jax-cache"):
        clock = _hook_clock(mp)
        step_compiles = _count_step_compiles(mp)
        mp.delenv("XLA_FLAGS", raising=False)
        summary = lora_sft.run(ctx)
        xla_flags = os.environ.get("XLA_FLAGS")  # as the stage left it (loraflow.trainer.maxtext_config)
    return {
        "xla_flags": xla_flags,
        "ctx": ctx,
        "summary": summary,
        "inputs": inputs,
        "clock": clock,
        "progress": lines,
        "step_compiles": step_compiles,
    }


def _count_step_compiles(mp: pytest.MonkeyPatch) -> list[int]:
    """How many programs XLA compiled while lora_sft read its compiled train step's memory
    (``loraflow.trainer.memory.compiled_step_bytes``), one count a call."""
    import jax
    from jax._src import dispatch

    from loraflow.trainer import training

    counts: list[int] = []
    real = training.compiled_step_bytes

    def counted(*args, **kwargs):
        compiled: list[float] = []

        def listener(event: str, seconds: float, **_: object) -> None:
            if event == dispatch.BACKEND_COMPILE_EVENT:
                compiled.append(seconds)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            return real(*args, **kwargs)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
            counts.append(len(compiled))

    mp.setattr(training, "compiled_step_bytes", counted)
    return counts


def _hook_clock(mp: pytest.MonkeyPatch) -> dict[str, list]:
    """A clock beside the stage's own, read where the TPU bench reads one (bench/tpu/_case.py): as MaxText's
    own step-end hook returns (loraflow's hook calls it first, then logs the step and writes its curves), as
    loraflow's step-start hook returns, and each started batch's non-padding tokens."""
    import time

    from maxtext.trainers.post_train.sft.hooks import SFTTrainingHooks

    from loraflow.trainer.hooks import LoraflowHooks, tokens_in

    clock: dict[str, list] = {"starts": [], "ends": [], "tokens": []}
    start, end = LoraflowHooks.on_train_step_start, SFTTrainingHooks.on_train_step_end

    def on_start(self, train_ctx):
        start(self, train_ctx)
        clock["starts"].append(time.perf_counter())
        clock["tokens"].append(tokens_in(train_ctx.data_hooks.train_batch["inputs_segmentation"]))

    def on_end(self, *args, **kwargs):
        end(self, *args, **kwargs)
        clock["ends"].append(time.perf_counter())

    mp.setattr(LoraflowHooks, "on_train_step_start", on_start)
    mp.setattr(SFTTrainingHooks, "on_train_step_end", on_end)
    return clock


def test_lora_sft_outputs_and_learns_parity(base, trained):
    import llama_numpy

    out, s = trained["ctx"].out, trained["summary"]
    assert s["steps"] == SFT["steps"] and s["resumed_from_step"] is None
    assert trained["xla_flags"] is None  # MaxText's config would have XLA dump every train step into /tmp
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, SFT["steps"] + 1))
    first = sum(float(r["loss"]) for r in rows[:5]) / 5
    last = sum(float(r["loss"]) for r in rows[-10:]) / 10
    assert last < first - 1.0, (first, last)
    assert s["lora_b_norm"] > 0
    _assert_curves_match_loss_csv(out, rows)
    # its trainer was built with LoRA applied under jit (loraflow.trainer.lora_apply): no second copy of the base
    assert any(line.startswith("LoRA applied under jit: ") for line in trained["progress"]), trained["progress"]
    # and its step donates the model (loraflow.trainer.donation): no copy of the frozen weights a step
    donated = "train step jitted with model and optimizer donated: no copy of the frozen weights"
    assert trained["progress"].count(donated) == 1, trained["progress"]
    # on this CPU its batches were prepared in the loop (loraflow.trainer.batches_ahead): the step needs the cores
    in_loop = "training batches prepared in the loop: the step runs on this host's CPU, whose cores a thread reading ahead would take"
    assert trained["progress"].count(in_loop) == 1, trained["progress"]
    assert not [line for line in trained["progress"] if "pipeline in a process of its own" in line]
    # its compiled step's memory was read from the step that ran: nothing compiled again for it
    assert trained["step_compiles"] == [0] and s["step_temp_bytes"] > 0
    assert any(line.startswith("compiled train step, per device: ") for line in trained["progress"])

    meta = json.loads((out / "adapter" / "loraflow_adapter.json").read_text())
    assert meta["rank"] == 16 and meta["alpha"] == 32.0 and meta["steps"] == SFT["steps"]
    assert (out / "adapter" / "model_params").is_dir()
    acfg = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert acfg["r"] == 16 and acfg["lora_alpha"] == 32.0
    assert set(acfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    from safetensors.numpy import load_file

    t = load_file(str(out / "peft" / "adapter_model.safetensors"))
    assert t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (16, 128)
    assert t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (128, 16)
    assert t["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (64, 16)
    assert t["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (16, 256)

    # The merged HF-layout weights (independent numpy Llama) answer held-out prompts; the base can't.
    acc = llama_numpy.parity_accuracy(base["hf"], PARITY / "eval.jsonl", out / "peft", n=40)
    base_acc = llama_numpy.parity_accuracy(base["hf"], PARITY / "eval.jsonl", None, n=10)
    assert acc >= 0.8 and base_acc <= 0.2, (acc, base_acc)


def test_batches_read_ahead_train_the_same_steps_on_the_same_data(base, trained, monkeypatch):
    """As on an accelerator: MaxText's pipeline in a worker process of its own, read 2 batches ahead in a
    thread, trains exactly what the loop's own reading trained (loss.csv's losses and tokens equal as text),
    says so once and leaves no thread and no process."""
    import multiprocessing

    from loraflow.steps import lora_sft
    from loraflow.trainer import batches_ahead

    real = batches_ahead.prepare_batches_ahead
    monkeypatch.setattr(batches_ahead, "prepare_batches_ahead", lambda *a, **k: real(*a, **k, backend="tpu"))
    monkeypatch.setattr(batches_ahead, "data_workers", lambda: batches_ahead.WORKERS)
    before = {p.pid for p in multiprocessing.active_children()}
    root = base["root"] / "sft-ahead"
    ctx = _ctx(root, "lora_sft", trained["inputs"], dict(SFT), str(base["root"] / "remote" / "lora_sft_ahead"))
    lines: list[str] = []
    ctx.progress = lines.append  # type: ignore[method-assign]
    lora_sft.run(ctx)
    assert lines.count("training batches prepared 2 ahead of the step, in a background thread") == 1, lines
    worker = "training data rendered, tokenized and packed by MaxText's pipeline in a process of its own"
    assert lines.count(worker) == 1, lines
    assert not [t for t in threading.enumerate() if t.name == "loraflow-batches-ahead"]
    assert not [p for p in multiprocessing.active_children() if p.pid not in before]

    def trained_on(out: Path) -> list[tuple[str, str, str]]:
        return [(r["step"], r["loss"], r["tokens"]) for r in csv.DictReader((out / "loss.csv").open())]

    ahead, in_loop = trained_on(ctx.out), trained_on(trained["ctx"].out)
    assert len(ahead) == SFT["steps"] and ahead == in_loop


def test_a_data_pipeline_that_fails_is_the_stage_s_error_not_data_running_out(base, tmp_path, monkeypatch):
    """MaxText's pipeline raising at its 4th batch (as a tokenizer error or a bad row would): MaxText logs it
    and ends the loop after 3 steps; the stage fails naming the exception and the step, its traceback in the
    task log, and writes no adapter (loraflow.trainer.data_failure)."""
    from loraflow.errors import LoraflowError
    from loraflow.steps import lora_sft
    from loraflow.trainer import hooks

    class FailsAtFourth:
        def __init__(self, source):
            self.source, self.read = source, 0

        def __iter__(self):
            return self

        def __next__(self):
            self.read += 1
            if self.read == 4:
                raise ValueError("row 29: the chat template has no 'tool' role")
            return next(self.source)

    real_skip = hooks.skip_trained_batches

    def with_a_failing_pipeline(trainer, n, progress):  # training.train calls it before the loop's readers
        real_skip(trainer, n, progress)
        loader = trainer.data_hooks.train_data_loader
        loader.data_iterator = FailsAtFourth(loader.data_iterator)

    monkeypatch.setattr(hooks, "skip_trained_batches", with_a_failing_pipeline)
    inputs = {"checkpoint": base["ckpt"], "dataset": base["dataset"], "tokenizer": base["hf"]}
    # the trained fixture's settings: its compiled programs (the session's cache) serve this run too
    ctx = _ctx(tmp_path, "lora_sft", inputs, dict(SFT), str(tmp_path / "remote"))
    lines: list[str] = []
    ctx.progress = lines.append  # type: ignore[method-assign]
    with pytest.raises(LoraflowError) as failed:
        lora_sft.run(ctx)
    assert str(failed.value) == (
        "training stopped at step 3 of 150: the data pipeline failed: ValueError: row 29: the chat template has no "
        "'tool' role (its traceback is in the task log above)"
    )
    assert lines[-1] == "ValueError: row 29: the chat template has no 'tool' role", lines[-5:]
    assert "Traceback (most recent call last):" in lines and not (ctx.out / "adapter").exists()


def test_qlora_nf4_trains_exports_and_merges_into_the_full_precision_base(base, trained, tmp_path):
    """QLoRA (issue 15): the targeted kernels' base weights held as nf4 while training; the adapter,
    exported as PEFT and merged into the full-precision HF base (what loraflow publishes), answers
    held-out parity prompts as the LoRA one does; the training state is smaller; the merge changes
    every targeted module (QLoRA renames the quantized kernels: a merge looking for them by name
    would change nothing)."""
    import llama_numpy

    from loraflow.lora.merge import merge_checkpoint
    from loraflow.steps import lora_sft

    lines: list[str] = []
    ctx = _ctx(
        tmp_path,
        "lora_sft",
        trained["inputs"],
        {**SFT, "quantization": "nf4", "tile_size": 64, "quantized_eval_examples": 40, "max_new_tokens": 4},
        str(tmp_path / "remote"),
    )
    ctx.progress = lines.append  # type: ignore[method-assign]
    with compiled_afresh(tmp_path / "jax-cache"):  # its compiled train step's memory is checked
        s = lora_sft.run(ctx)
    # The model as it trained (quantized base + adapter) answered the first 40 eval prompts itself.
    answers = [json.loads(line) for line in (ctx.out / "quantized_answers.jsonl").read_text().splitlines()]
    references = [json.loads(line)["completion"] for line in (PARITY / "eval.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == [str(i) for i in range(40)] and s["quantized_eval_examples"] == 40
    right = sum(a["output"].strip() == references[int(a["id"])] for a in answers)
    assert right >= 32, answers
    assert not (trained["ctx"].out / "quantized_answers.jsonl").exists()  # LoRA: the merged model is the trained one
    # The compiled train step's memory (XLA's analysis): the state it takes, the activations it makes.
    for summary in (s, trained["summary"]):
        assert summary["step_argument_bytes"] >= summary["train_state_bytes"] and summary["step_temp_bytes"] > 0
    # One process: the full-precision model was built and quantized in host memory (loraflow.trainer.host_build).
    assert any(line.startswith("QLoRA: base model restored into host memory") for line in lines), lines
    note = next(line for line in lines if line.startswith("QLoRA: ") and "kernel stacks" in line)
    assert "7 kernel stacks hold their base weights as nf4" in note and "tiles of 64" in note, note
    for kernel in ("self_attention/query", "self_attention/out", "mlp/wi_0", "mlp/wo"):
        assert f"decoder/layers/{kernel}" in note
    assert s["quantization"] == "nf4" and s["lora_b_norm"] > 0
    lora = trained["summary"]
    assert s["adapter_bytes"] == lora["adapter_bytes"]  # the same adapter, in full precision
    assert s["model_bytes"] < lora["model_bytes"] and s["train_state_bytes"] < lora["train_state_bytes"]
    meta = json.loads((ctx.out / "adapter" / "loraflow_adapter.json").read_text())
    assert (meta["quantization"], meta["tile_size"]) == ("nf4", 64)

    acc = llama_numpy.parity_accuracy(base["hf"], PARITY / "eval.jsonl", ctx.out / "peft", n=40)
    assert acc >= 0.8, acc
    report = merge_checkpoint(base["hf"], ctx.out / "peft", tmp_path / "merged")
    assert report.changed == report.merged == 2 * 7, (report.changed, report.merged)


def test_lora_sft_in_bfloat16_learns_and_its_peft_export_merges(base, trained, tmp_path):
    """``training.dtype: bfloat16`` (the production specs') trains: MaxText gets it as compute and weight
    dtype (with float32 weights qwix's LoRA branch made a layer's output float32 and MaxText's layer scan
    refused the carry), the base weights are held in half the bytes, and the adapter, exported as PEFT and
    merged into the float32 HF base, answers held-out parity prompts as the float32-trained one does."""
    import llama_numpy
    import numpy as np
    from safetensors.numpy import load_file

    from loraflow.steps import lora_sft

    ctx = _ctx(tmp_path, "lora_sft", trained["inputs"], {**SFT, "dtype": "bfloat16"}, str(tmp_path / "remote"))
    s = lora_sft.run(ctx)
    assert s["steps"] == SFT["steps"] and s["final_loss"] < s["first_loss"] - 1.0, s
    lora = trained["summary"]
    assert s["model_bytes"] - s["adapter_bytes"] <= (lora["model_bytes"] - lora["adapter_bytes"]) / 2 + 1024
    tensors = load_file(str(ctx.out / "peft" / "adapter_model.safetensors"))
    assert len(tensors) == 28 and all(np.isfinite(t.astype(np.float32)).all() for t in tensors.values())
    acc = llama_numpy.parity_accuracy(base["hf"], PARITY / "eval.jsonl", ctx.out / "peft", n=40)
    assert acc >= 0.8, acc


def test_a_qlora_adapter_that_changes_nothing_is_stopped_at_the_merge(base, trained, tmp_path):
    """The "adapter did nothing" guard under QLoRA: an adapter trained for real against the nf4 base,
    but with a learning rate so small that its update rounds away in the full-precision weights, merges
    into a checkpoint equal to the base bit for bit; merge_adapter refuses to pass it on."""
    from loraflow.steps import lora_sft, merge_adapter

    config = {**SFT, "quantization": "nf4", "tile_size": 64, "quantized_eval_examples": 0}
    config |= {"steps": 2, "checkpoint_period": 2, "learning_rate": 1e-20}
    ctx = _ctx(tmp_path / "sft", "lora_sft", trained["inputs"], config, str(tmp_path / "remote"))
    s = lora_sft.run(ctx)
    assert s["quantization"] == "nf4" and s["peft_tensors"] == 28
    merge = _ctx(tmp_path / "merge", "merge_adapter", {"base": base["hf"], "adapter": ctx.out}, {}, "gs://b/p/r/m")
    with pytest.raises(merge_adapter.NoOpMergeError, match="did nothing"):
        merge_adapter.run(merge)


def _assert_curves_match_loss_csv(out: Path, rows: list[dict[str, str]]) -> None:
    """tensorboard/ read back with TensorBoard's own reader: loss, step time and tokens/s equal loss.csv's
    step by step (to its printed digits), and the learning rate follows the warm-up to the spec's rate."""
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    got = scalars(events.parent)
    assert set(got) == {"train/loss", "train/learning_rate", "perf/step_seconds", "perf/tokens_per_s"}  # CPU: no HBM
    for column, tag, digits in [("loss", "train/loss", 6), ("seconds", "perf/step_seconds", 4)]:
        assert [(s, round(v, digits)) for s, v in sorted(got[tag].items())] == [
            (int(r["step"]), pytest.approx(float(r[column]), abs=1.5 * 10**-digits)) for r in rows
        ], tag
    tps = sorted(got["perf/tokens_per_s"].items())
    assert [(s, pytest.approx(v, abs=0.06, rel=1e-6)) for s, v in tps] == [
        (int(r["step"]), float(r["tokens_per_s"])) for r in rows
    ]
    rates = [v for _, v in sorted(got["train/learning_rate"].items())]
    assert rates[0] < rates[10] and max(rates) == pytest.approx(SFT["learning_rate"], rel=1e-3)


def test_lora_sft_step_times_match_a_clock_beside_the_stage(trained):
    """loss.csv's seconds and tokens, and the summary's rates, against a clock read in the hooks beside the
    stage's: the first row runs from the attempt's first step start (its compile included, reported apart),
    every other from the previous step's end (the last one too: Tunix reports it after its loop), and each
    row counts its own batch's tokens."""
    import itertools
    import statistics

    clock, s = trained["clock"], trained["summary"]
    rows = list(csv.DictReader((trained["ctx"].out / "loss.csv").open()))
    ends = clock["ends"]
    gaps = [ends[0] - clock["starts"][0]] + [b - a for a, b in itertools.pairwise(ends)]
    assert len(rows) == len(gaps) == len(clock["tokens"]) == SFT["steps"]
    steady = gaps[1:]
    # a row may differ from its gap by a busy CPU's scheduling (the two clocks are read a few lines apart);
    # a step counted twice or a compile left out differs by a whole step or more
    slack = statistics.median(steady) / 2
    for row, gap, tokens in zip(rows, gaps, clock["tokens"], strict=True):
        assert float(row["seconds"]) == pytest.approx(gap, abs=slack), (row, gap)
        assert int(row["tokens"]) == tokens, (row, tokens)
    assert s["first_step_seconds"] == pytest.approx(gaps[0], rel=0.02, abs=1e-3)
    assert s["first_step_seconds"] > 3 * statistics.median(steady)  # it compiles
    assert s["median_step_seconds"] == pytest.approx(statistics.median(steady), rel=0.02, abs=1e-3)
    assert s["mean_step_seconds"] == pytest.approx(statistics.mean(steady), rel=0.02)
    assert s["compile_seconds"] == pytest.approx(gaps[0] - statistics.median(steady), rel=0.02, abs=2e-3)
    assert s["tokens_per_s"] == pytest.approx(sum(clock["tokens"][1:]) / sum(steady), rel=0.02)
    rates = [t / g for t, g in zip(clock["tokens"][1:], steady, strict=True)]
    assert s["median_tokens_per_s"] == pytest.approx(statistics.median(rates), rel=0.02)


def test_lora_sft_resumes_from_persisted_checkpoint(base, trained):
    """A second attempt of the same stage (fresh scratch dirs, as on a new host) resumes."""
    from loraflow.steps import lora_sft
    from loraflow.storage import checkpoint_sync

    remote = trained["ctx"].output_uri + "/_checkpoints"
    assert checkpoint_sync.remote_steps(remote)[-1] == SFT["steps"]
    cfg = {**SFT, "steps": SFT["steps"] + 10}
    ctx = _ctx(base["root"] / "sft2", "lora_sft", trained["inputs"], cfg, trained["ctx"].output_uri)
    s = lora_sft.run(ctx)
    assert s["resumed_from_step"] == SFT["steps"] and s["steps"] == SFT["steps"] + 10
    rows = list(csv.DictReader((ctx.out / "loss.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(SFT["steps"] + 1, SFT["steps"] + 11))
    # resumed, not restarted: the loss continues from the trained level, not from ~6
    assert float(rows[0]["loss"]) < trained["summary"]["first_loss"] - 1.0
    assert checkpoint_sync.remote_steps(remote)[-1] == SFT["steps"] + 10


def _upload(local: Path, prefix: str) -> None:
    from loraflow.storage import artifacts

    artifacts.upload_tree(local, prefix)


def test_lora_sft_killed_mid_training_resumes_through_gcs_to_the_same_adapter(base, trained, gcs_bucket, tmp_path):
    """The real step program, checkpoints in the GCS emulator: SIGKILL after the first persisted
    checkpoint, then the retry resumes from it and ends with the uninterrupted run's adapter."""
    import subprocess

    import numpy as np
    from safetensors.numpy import load_file

    from loraflow.launchers.local import step_environment
    from loraflow.storage import artifacts, checkpoint_sync

    ckpt = f"{gcs_bucket}/src/convert_checkpoint"
    files = artifacts.upload_tree(base["ckpt"], ckpt)
    manifest = artifacts.commit(
        ckpt, files, stage="convert_checkpoint", inputs={}, config={}, lock_version="L", cache_key="C", summary={}
    )
    _upload(base["dataset"], f"{gcs_bucket}/src/dataset")
    _upload(base["hf"], f"{gcs_bucket}/src/hf")
    output = f"{gcs_bucket}/p/run-1/lora_sft"
    argv = [
        sys.executable, "-m", "loraflow.steps.lora_sft", "--output", output,
        "--input", f"checkpoint={manifest.uri}", "--input", f"dataset={gcs_bucket}/src/dataset",
        "--input", f"tokenizer={gcs_bucket}/src/hf", "--config-json", json.dumps(SFT), "--cache-key", "K",
    ]  # fmt: skip
    # Killed right after the second persisted checkpoint (Tunix saves step 1, then every period).
    fault = {"LORAFLOW_FAULT": "mid_training@2", "LORAFLOW_FAULT_STATE": str(tmp_path)}
    env = {**os.environ, **step_environment(fault)}

    first = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-2000:]
    assert checkpoint_sync.remote_steps(output + "/_checkpoints")[-1] == SFT["checkpoint_period"]
    with pytest.raises(Exception, match="missing"):
        artifacts.read_manifest(output)

    retry = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
    done = artifacts.read_manifest(output)
    assert done.summary["resumed_from_step"] == SFT["checkpoint_period"]
    artifacts.fetch(done, tmp_path / "resumed", only=["peft/adapter_model.safetensors"])
    resumed = load_file(str(tmp_path / "resumed" / "peft" / "adapter_model.safetensors"))
    reference = load_file(str(trained["ctx"].out / "peft" / "adapter_model.safetensors"))
    assert resumed.keys() == reference.keys()
    worst = max(float(np.max(np.abs(resumed[k] - reference[k]))) for k in reference)
    scale = max(float(np.max(np.abs(reference[k]))) for k in reference)
    assert worst <= 1e-3 * scale, (worst, scale)


@pytest.mark.parametrize("hardware", ["tpu", "gpu", "cpu"])
def test_maxtext_never_starts_the_distributed_system_itself(base, hardware):
    """One TPU host with checkpointing on: left to MaxText, it calls jax.distributed.initialize() and waits
    for a coordinator nobody runs. loraflow's multihost module joins a job of several processes before
    MaxText runs, so MaxText is told to skip it on every hardware; the spec's dtype is its weight dtype too."""
    from maxtext.configs import pyconfig

    from loraflow.spec.step_configs import LoraSftConfig, parse
    from loraflow.trainer.argv import sft_argv
    from loraflow.trainer.converted import ConvertedModel
    from loraflow.trainer.data import TrainingSet, prepare

    cfg = parse(LoraSftConfig, {**SFT, "dtype": "bfloat16", "hardware": hardware})
    model = ConvertedModel(SFT["model_name"], dict(OVERRIDES), True, "/nowhere")
    data = prepare(cfg, TrainingSet(base["dataset"] / "train.jsonl", 100), base["hf"])
    argv = sft_argv(cfg, model, data, base["hf"], str(base["root"] / f"argv-{hardware}"))
    assert "skip_jax_distributed_system=true" in argv and f"hardware={hardware}" in argv
    if hardware == "cpu":
        import jax

        mt = pyconfig.initialize_pydantic(argv)
        assert mt.skip_jax_distributed_system is True
        assert {str(mt.dtype).lower(), str(mt.weight_dtype).lower()} == {"dtype.bfloat16"}
        # MaxText points JAX's compilation cache at its jax_cache_dir (~/jax_cache unless told): here the
        # folder the environment names, the session's own (tests/conftest.py)
        assert jax.config.jax_compilation_cache_dir == os.environ["JAX_COMPILATION_CACHE_DIR"]


def test_the_compilation_cache_a_step_is_given_is_the_one_maxtext_uses(monkeypatch, tmp_path):
    """JAX_COMPILATION_CACHE_DIR (the worker's, passed through by the local launcher) reaches MaxText as its
    jax_cache_dir in both trainer steps' command lines; without it MaxText keeps its own default."""
    from loraflow.steps.convert_checkpoint import _converter_args
    from loraflow.trainer.argv import compile_cache_args

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))
    assert compile_cache_args() == [f"jax_cache_dir={tmp_path}"]
    assert f"jax_cache_dir={tmp_path}" in _converter_args(tmp_path, "llama3.1-8b", OVERRIDES, True, {})
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert not any(
        a.startswith("jax_cache_dir=") for a in _converter_args(tmp_path, "llama3.1-8b", OVERRIDES, True, {})
    )


def test_a_step_lasts_from_the_previous_step_end_to_its_own():
    """The progress lines' and loss.csv's step seconds and tokens/s count the time the trainer spends between
    the hooks (JAX dispatches a step and returns; the chip works on): on a TPU v5e a 1 B model's 0.58 s steps
    read as 0.02 s when timed from the step's own start hook. The hooks come in Tunix's order: a step's end
    after the next step's start, the last end after the loop. Here the first step compiles for 0.3 s, and
    each later one runs 0.2 s on the chip."""
    import time

    import numpy as np

    from loraflow.trainer.hooks import tokens_in
    from loraflow.trainer.step_log import StepLog

    lines: list[str] = []
    log = StepLog(lines.append, steps=3, log_every=1)
    batches = [np.ones((2, n), np.int32) for n in (50, 40, 30)]
    log.step_started(tokens_in(batches[0]))
    time.sleep(0.3)  # step 1 compiles and runs
    for step in (2, 3):
        log.step_started(tokens_in(batches[step - 1]))  # the next step starts before the last one's end
        log.step_ended(step - 1, 1.0)
        time.sleep(0.2)
    log.step_ended(3, 1.0)  # after the loop
    rows = log.rows
    assert [r.tokens for r in rows] == [100, 80, 60]  # each step its own batch's
    assert 0.3 <= rows[0].seconds < 0.45  # the attempt's first step: from its own start
    assert "compiling included" in lines[0] and "compiling" not in lines[1]
    for step, _, tps, seconds, tokens in rows[1:]:
        assert 0.2 <= seconds < 0.35, (step, seconds)  # the last one too (it read double)
        assert tps == pytest.approx(tokens / seconds)


def _rows(*steps: tuple[float, int]) -> list:
    from loraflow.trainer.step_log import StepRow

    return [StepRow(i + 11, 1.0, tokens / seconds, seconds, tokens) for i, (seconds, tokens) in enumerate(steps)]


def test_step_times_keep_the_compiling_first_step_apart():
    """The summary's figures: the attempt's first row (a resumed attempt's too) compiles; the others'
    mean rate is their tokens over their seconds, and the median of their rates and seconds beside it."""
    from loraflow.trainer.step_log import StepTimes, step_times

    t = step_times(_rows((5.0, 100), (1.0, 100), (2.0, 50), (4.0, 200), (1.0, 100)))
    assert t == StepTimes(
        first_step_seconds=5.0,
        compile_seconds=5.0 - 1.5,
        mean_step_seconds=2.0,
        median_step_seconds=1.5,
        tokens_per_s=450 / 8.0,
        median_tokens_per_s=(50 + 100) / 2,  # of 100, 25, 50, 100
    )
    assert step_times(_rows((0.5, 100), (1.0, 100))).compile_seconds == 0.0  # never below nothing
    assert step_times(_rows((5.0, 100))) == StepTimes(5.0, None, None, None, None, None)
    assert step_times([]) == StepTimes(None, None, None, None, None, None)


# The families beyond Llama (whose steps the tests above cover): each family's tiny model (its real HF
# architecture) through convert -> train -> PEFT export -> merge, the merge checked against W + (alpha/r) B A.
OTHER_FAMILIES = [name for name in tinymodel.FAMILIES if name != "llama"]
# Each family's tiny checkpoint's parameter count, and a MaxText model of the other kind of output
# projection (tied to the embedding or not), which the dimension check refuses (every MaxText Gemma 3 is
# tied: a Llama one).
TINY_FACTS = {"qwen3": (361344, "qwen3-8b"), "gemma3": (1102336, "llama3.1-8b")}
# Each family's training steps: as few as its tiny model needs to learn the parity task with room to spare,
# measured (2026-12-06, this module's config; merged, 40 held-out prompts): the tiny Gemma 3 answers all 40
# after 40, 60 and 80 steps (loss 6.03 -> 1.54, 1.50, 1.53), so 150 only added ~0.3 CPU s a step; the tiny
# Qwen3 answers 21 of 40 after 40 (loss 6.46 -> 4.09) and keeps the Llama runs' 150.
FAMILY_STEPS = {"qwen3": SFT["steps"], "gemma3": 40}


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_a_family_converts_trains_exports_and_merges(family, tmp_path_factory):
    import llama_numpy
    import numpy as np
    from safetensors.numpy import load_file

    from loraflow.lora.merge import merge_checkpoint
    from loraflow.steps import convert_checkpoint, lora_sft

    entry = tinymodel.tiny(family)
    parameters, other_kind = TINY_FACTS[family]
    root = tmp_path_factory.mktemp(family)
    fam = _tiny_base(root, family)
    assert fam["convert_summary"]["parameters"] == parameters
    with pytest.raises(Exception, match=r"tie_word_embeddings=\w+ vs MaxText logits_via_embedding"):
        convert_checkpoint.convert(fam["hf"], root / "wrong", other_kind, entry.maxtext_overrides)

    inputs = {"checkpoint": fam["ckpt"], "dataset": fam["dataset"], "tokenizer": fam["hf"]}
    config = {**SFT, "model_name": entry.maxtext_model, "model_overrides": entry.maxtext_overrides}
    config["steps"] = FAMILY_STEPS[family]
    ctx = _ctx(root / "sft", "lora_sft", inputs, config, str(root / "remote" / "lora_sft"))
    s = lora_sft.run(ctx)
    assert s["steps"] == FAMILY_STEPS[family] and s["final_loss"] < s["first_loss"] - 1.0, s
    peft_dir = ctx.out / "peft"
    acfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert set(acfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    adapter = load_file(str(peft_dir / "adapter_model.safetensors"))
    layers = entry.dims["num_hidden_layers"]
    assert len(adapter) == 2 * 7 * layers  # lora_A and lora_B of 7 modules in every layer

    # The merge against an independent W + (alpha/r) B A, in float64, for every tensor of the checkpoint.
    report = merge_checkpoint(fam["hf"], ctx.out, root / "merged")
    assert report.merged == report.changed == 7 * layers
    scale = acfg["lora_alpha"] / acfg["r"]
    base_w = load_file(str(fam["hf"] / "model.safetensors"))
    merged = {k: v for f in sorted((root / "merged").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(merged) == set(base_w) and ("lm_head.weight" in merged) is not entry.tied_embeddings
    targeted = set()
    for key, a in adapter.items():
        if ".lora_A." in key:
            b = adapter[key.replace(".lora_A.", ".lora_B.")].astype(np.float64)
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            want = base_w[name].astype(np.float64) + scale * (b @ a.astype(np.float64))
            np.testing.assert_allclose(merged[name], want, rtol=1e-5, atol=1e-6)
            targeted.add(name)
    assert all(np.array_equal(merged[k], base_w[k]) for k in set(base_w) - targeted)  # q/k norms, embedding ...

    # The merged checkpoint (an independent numpy forward of the family) answers held-out prompts; the base can't.
    acc = llama_numpy.parity_accuracy(root / "merged", PARITY / "eval.jsonl", None, n=40)
    base_acc = llama_numpy.parity_accuracy(fam["hf"], PARITY / "eval.jsonl", None, n=10)
    assert acc >= 0.8 and base_acc <= 0.2, (acc, base_acc)
