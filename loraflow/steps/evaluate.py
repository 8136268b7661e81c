"""evaluate: generate answers for the eval set with vLLM and score them (evaluate_base, evaluate_tuned).

One program serves both evaluation stages; the stage label is the last path component of
``--output`` (``.../evaluate_base`` or ``.../evaluate_tuned``), "evaluate" when there is none.

Inputs
    ``model``    a Hugging Face checkpoint directory: config.json, ``*.safetensors`` (one file, or
                 shards with ``model.safetensors.index.json``) and its tokenizer files.
    ``eval_set`` the validate_data artifact: a directory holding ``eval.jsonl`` with rows
                 ``{"id", "messages": [{"role": "user", "content": ...}], "reference"}``
                 (``{"prompt", "completion"}`` rows are accepted too).
    ``guard_set`` only for a ``guard_set`` that is a gs:// URI: the regression guard's JSONL
                 (:mod:`loraflow.evaluation.guard`); a shipped set is read from the package.

Config (``loraflow.spec.step_configs.EvaluateConfig``; defaults the spec's ``evaluation`` and
``training.dtype``)
    ``max_new_tokens``, ``batch_size``, ``seed``, ``answer_pattern`` (see :mod:`loraflow.evaluation.scoring`),
    ``max_examples`` (first N rows; null = all), ``max_model_len``, ``answer_format``, ``relative_tolerance``,
    ``metrics`` (the metrics scored; the planner adds ``gate.metric``), ``dtype``, ``guard_set`` (the spec's
    ``gate.guard.set``; absent: no guard); internal (not spec
    keys): ``temperature`` (0 = greedy) and engine keys for serving hosts: ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``distributed_executor_backend`` (null: "uni" for one device, vLLM's choice otherwise),
    ``enforce_eager`` (null: true on CPU), ``kv_cache_memory_bytes`` (null: on CPU what
    ``batch_size`` sequences of ``max_model_len`` tokens fill, at most a quarter of the memory; vLLM's
    profiling elsewhere), ``gpu_memory_utilization``, ``engine_args`` (any other ``vllm.LLM`` kwargs).

Prompts are rendered by :mod:`loraflow.data.chat_template` with the template validate_data recorded
beside the eval set (``chat_template.json``, the one training renders with; an eval set without it
falls back to the tokenizer's own, with a warning), the generation prompt added, tokenised piece by
piece as training tokenises them, without extra special tokens (the template writes them), and
handed to vLLM as token ids. ``metrics.json`` names the template (``chat_template``: setting,
origin, sha256) and warns in the log when the model's own tokenizer template differs from it. The
engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
the same argv runs on a laptop CPU, a GPU host or a TPU host. The program leaves the engine to the
end of its process rather than tearing it down first (:meth:`Engine.leave_to_exit`).

Output
    ``predictions.jsonl`` (and ``predictions.parquet`` when pyarrow or fastparquet is installed):
    one row per example with id, prompt, reference, generation, answer and each scored metric's
    column (correct, format_ok, ...: loraflow/evaluation/metrics.py).
    ``metrics.json``: every scored metric (accuracy, format_rate, ...), n, the per-example ``ids`` and
    metric columns in eval-set order (for the gate's paired comparison), the chat template that
    rendered the prompts, timings, settings; with a guard set, ``guard`` (its name, sha256, n,
    accuracy and per-question lists: :mod:`loraflow.steps._guard` scores it in the same engine).
    ``guard_predictions.jsonl``: with a guard set, one row per question with the options' scores,
    the choice and whether it is right.
    ``suite_samples_<name>.jsonl``: with ``evaluation.suites``, lm-eval's per-document records of each
    standard benchmark, whose figure is metrics.json's ``suites`` (:mod:`loraflow.steps._suites`).
    ``tensorboard/``: the scores as TensorBoard scalars (``eval/<metric>``, ``guard/accuracy``, ``suite/<name>``) at
    the evaluated model's training step (0: the base model; :mod:`loraflow.reporting.curves`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.data.chat_template import ChatTemplate
from loraflow.errors import LoraflowError
from loraflow.evaluation import guard
from loraflow.evaluation import metrics as metric_table
from loraflow.evaluation.examples import Example, eval_template, find_eval_file, load_examples, render_prompts
from loraflow.reporting.curves import evaluation_scalars, scalar_writer, trained_steps
from loraflow.spec.stages import METRICS_JSON, PREDICTIONS_JSONL, PREDICTIONS_PARQUET
from loraflow.spec.step_configs import EvaluateConfig, parse
from loraflow.steps import _guard
from loraflow.steps._harness import StepContext, import_permanently, run_and_exit

#: The CPU backend's KV cache, when the config does not say, is what ``batch_size`` sequences of
#: ``max_model_len`` tokens can fill (vLLM's own default takes about half the machine's memory, which it
#: zero-fills at start-up, and profiles a warm-up pass first: ~30 s on 2 cores), at most this share of
#: the machine's memory, and at least one whole sequence (plus the one block vLLM keeps for itself).
CPU_KV_CACHE_MAX_SHARE = 0.25
#: ... or this, for a checkpoint whose config.json does not give the attention's shape.
CPU_KV_CACHE_BYTES = 256 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
#: vLLM's CPU backend keeps the KV cache in blocks of this many tokens (its default for Llama's attention).
KV_BLOCK_TOKENS = 128


# ------------------------------------------------------------------------------------ config


def resolve_config(config: dict[str, Any]) -> EvaluateConfig:
    """The stage config, checked (``loraflow.spec.step_configs.EvaluateConfig``: the spec's defaults)."""
    return parse(EvaluateConfig, config)


# ------------------------------------------------------------------------------------ inputs


def find_model_dir(root: Path) -> Path:
    """The checkpoint directory inside an input: ``root`` itself or the one folder below holding config.json."""
    if (root / "config.json").is_file():
        model_dir = root
    else:
        found = sorted({p.parent for p in root.rglob("config.json")}, key=lambda p: (len(p.parts), str(p)))
        if not found:
            raise LoraflowError(f"evaluate: model input {root} holds no config.json (not a Hugging Face checkpoint)")
        if len(found) > 1 and len(found[0].parts) == len(found[1].parts):
            raise LoraflowError(f"evaluate: model input holds several checkpoints: {[str(p) for p in found]}")
        model_dir = found[0]
    check_checkpoint(model_dir)
    return model_dir


def check_checkpoint(model_dir: Path) -> None:
    """Fail early, with a message, on a checkpoint vLLM would reject obscurely."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if not shards or missing:
            raise LoraflowError(f"evaluate: {index.name} names shard(s) that are missing: {missing or 'none listed'}")
    elif not any(model_dir.glob("*.safetensors")):
        raise LoraflowError(f"evaluate: no *.safetensors weights in {model_dir}")
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise LoraflowError(f"evaluate: no tokenizer files in {model_dir}; the checkpoint must carry its tokenizer")


# ------------------------------------------------------------------------------------ engine


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_kwargs(model_dir: Path, cfg: EvaluateConfig, cpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments for a resolved config on this platform."""
    parallel = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "enforce_eager": cpu if cfg.enforce_eager is None else bool(cfg.enforce_eager),
        "max_num_seqs": max(cfg.batch_size, 1),
        "disable_log_stats": True,
    }
    backend = cfg.distributed_executor_backend or ("uni" if parallel == 1 else None)
    if backend:
        kwargs["distributed_executor_backend"] = backend
    kv = cfg.kv_cache_memory_bytes or (cpu_kv_cache_bytes(model_dir, cfg, _memory_bytes()) if cpu else None)
    if kv:
        kwargs["kv_cache_memory_bytes"] = int(kv)
    if cfg.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = float(cfg.gpu_memory_utilization)
    kwargs.update(cfg.engine_args)
    return kwargs


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int | None:
    """Keys and values of one token over all layers, from a Hugging Face config.json; None when it does
    not give the attention's shape."""
    try:
        layers, heads = int(model_config["num_hidden_layers"]), int(model_config["num_attention_heads"])
        kv_heads = int(model_config.get("num_key_value_heads") or heads)
        head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def cpu_kv_cache_bytes(model_dir: Path, cfg: EvaluateConfig, memory_bytes: int) -> int:
    """The CPU backend's KV cache for this checkpoint and config (see :data:`CPU_KV_CACHE_MAX_SHARE`)."""
    per_token = kv_bytes_per_token(json.loads((model_dir / "config.json").read_text()), cfg.dtype)
    if per_token is None:
        return CPU_KV_CACHE_BYTES
    # a sequence holds whole blocks of the cache; vLLM keeps one block for itself
    block = KV_BLOCK_TOKENS * per_token
    sequence = -(-cfg.max_model_len // KV_BLOCK_TOKENS) * block
    return block + max(sequence, min(cfg.batch_size * sequence, int(memory_bytes * CPU_KV_CACHE_MAX_SHARE)))


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_LEFT_TO_EXIT: list[Any] = []  # engines kept for the end of the process (Engine.leave_to_exit)


@dataclass
class Engine:
    """A loaded ``vllm.LLM`` and what it was built with."""

    llm: Any
    model_dir: Path
    kwargs: dict[str, Any]
    startup_s: float
    device: str
    vllm_version: str
    import_s: float = 0.0
    closed: bool = field(default=False)

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def _core(self) -> Any:
        """vLLM's engine-core client (``InprocClient`` in this process), or None."""
        return getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)

    def close(self) -> None:
        """Shut the engine core down and drop the model (memory back before the process ends)."""
        if self.closed:
            return
        self.closed = True
        core = self._core()
        if core is not None and hasattr(core, "shutdown"):
            try:
                core.shutdown()
            except Exception:  # best effort at teardown
                pass
        self.llm = None
        gc.collect()

    def leave_to_exit(self) -> None:
        """Leave the engine to the end of the process, for a process that ends next (the step program).

        Otherwise vLLM's engine core shuts itself down (a weakref finalizer: when the engine is dropped,
        or at exit): it unfreezes every object (the frozen import too, see :func:`import_permanently`),
        collects them all and destroys its one-rank process group. On 2 cores that took 1.4 s at exit,
        1.8-1.9 s as :meth:`close` before the step's commit, and freed nothing the end of the process
        does not. So the finalizer is told not to run at exit, and the engine is kept referenced until
        then. Worker processes, where vLLM runs any, are still stopped at exit by their executor's own
        finalizer. In a process that goes on, the engine's memory stays held: call :meth:`close` there.
        """
        if self.closed:
            return
        self.closed = True
        finalizer = getattr(self._core(), "_finalizer", None)
        if finalizer is not None:
            finalizer.atexit = False
        _LEFT_TO_EXIT.append(self.llm)


def build_engine(model_dir: Path, cfg: EvaluateConfig, progress: Any = print) -> Engine:
    """Load the checkpoint into an in-process ``vllm.LLM`` for a resolved config."""
    # In-process engine core: no engine subprocess to spawn, a clean traceback on failure.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    started = time.monotonic()
    # vllm's top level is lazy: the engine's own modules (about half the import) load with vllm.LLM
    import_s = import_permanently("vllm", "vllm.entrypoints.llm")
    import vllm
    from vllm import LLM

    cpu = on_cpu()
    kwargs = engine_kwargs(model_dir, cfg, cpu)
    shown = {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")}
    progress(f"loading {model_dir} into vLLM {vllm.__version__} ({'cpu' if cpu else 'accelerator'}): {shown}")
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # vLLM raises many kinds; say which checkpoint and settings failed
        raise LoraflowError(
            f"evaluate: vLLM could not load {model_dir} with {shown}: {type(exc).__name__}: {exc}"
        ) from exc
    from vllm.platforms import current_platform

    startup = time.monotonic() - started
    progress(f"vLLM ready in {startup:.1f}s ({import_s:.1f}s of it importing vllm)")
    return Engine(llm, model_dir, kwargs, startup, str(current_platform.device_name), vllm.__version__, import_s)


# ------------------------------------------------------------------------------------ evaluate


def evaluate(ctx: StepContext, engine: Engine | None = None, *, process_ends: bool = False) -> dict[str, Any]:
    """:func:`run` with an optional already-loaded engine (reused by tests, and left open). One built
    here is closed at the end, or with ``process_ends`` left to the process's end (:meth:`Engine.leave_to_exit`)."""
    started = time.monotonic()
    cfg = resolve_config(ctx.config)
    model_dir = find_model_dir(ctx.inputs["model"])
    eval_file = find_eval_file(ctx.inputs["eval_set"])
    examples = load_examples(eval_file, cfg.max_examples)
    ctx.progress(f"{len(examples)} example(s) from {eval_file.name}; model {model_dir.name}")
    template = eval_template(eval_file, model_dir, ctx.progress)
    ctx.progress(f"chat template: {template.origin} (sha256 {template.digest[:12]})")
    guard_set = _guard.load(cfg, ctx.inputs)  # read and checked before the engine loads
    suites = _load_suites(cfg, ctx.inputs)  # ... and so is every staged suite's task

    own_engine = engine is None
    if engine is None:
        engine = build_engine(model_dir, cfg, ctx.progress)
    try:
        return _evaluate(ctx, engine, cfg, examples, template, guard_set, suites, started)
    finally:
        if own_engine and process_ends:
            engine.leave_to_exit()
        elif own_engine:
            engine.close()


def _evaluate(
    ctx: StepContext,
    engine: Engine,
    cfg: EvaluateConfig,
    examples: list[Example],
    template: ChatTemplate,
    guard_set: _guard.GuardSet | None,
    suites: list[Any],
    started: float,
) -> dict[str, Any]:
    sampling = _sampling_params(cfg)
    texts, prompt_ids = render_prompts(engine.tokenizer, examples, template)
    _check_prompts_fit(prompt_ids, cfg)
    guard_seqs = _guard.sequences(engine, cfg, template, guard_set) if guard_set is not None else []
    gen = _generate(ctx, engine, sampling, prompt_ids, cfg.batch_size)

    settings = metric_table.Scoring.of(cfg)  # the metrics the spec chooses, the answer's source, the tolerance
    scored = metric_table.score_all(gen.texts, [ex.reference for ex in examples], settings)
    metrics = metric_table.aggregate(scored, settings.metrics)
    rates = {m.name: metrics[m.name] for m in settings.chosen}

    written = _write_predictions(ctx.out, examples, texts, gen.texts, scored, gen.tokens, gen.finish)
    report = _metrics_report(
        ctx.stage, cfg, engine, examples, metrics, settings.chosen, _timing(engine, gen, prompt_ids)
    )
    report["chat_template"] = template.summary()
    if guard_set is not None:
        report["guard"] = _guard.score(engine, cfg, guard_set, guard_seqs, ctx.out, ctx.progress)
        written.append(guard.PREDICTIONS_FILE)
    if suites:
        from loraflow.steps import _suites

        report["suites"] = _suites.run(engine, cfg, template, suites, ctx.out, ctx.progress)
        written.extend(_suites.SAMPLES_FILE.format(name=name) for name in report["suites"])
    report["files"] = [*written, METRICS_JSON]
    (ctx.out / METRICS_JSON).write_text(json.dumps(report, indent=1) + "\n")
    _write_curves(ctx, rates, report.get("guard"), report.get("suites"))
    ctx.progress(
        ", ".join(f"{name} {value:.4f}" for name, value in rates.items())
        + f" over n={metrics['n']}; {gen.total_tokens} tokens at {gen.tokens_per_s:.0f} tok/s"
    )
    return {
        **rates,
        "n": metrics["n"],
        **({"guard_accuracy": report["guard"]["accuracy"]} if guard_set is not None else {}),
        **{f"suite_{name}": entry["value"] for name, entry in report.get("suites", {}).items()},
        "tokens_per_s": round(gen.tokens_per_s, 1),
        "seconds": round(time.monotonic() - started, 2),
    }


def _write_curves(
    ctx: StepContext, rates: dict[str, float], guard_summary: dict[str, Any] | None, suites: dict[str, Any] | None
) -> None:
    """tensorboard/: the scores at the evaluated model's training step (0: the base model), beside lora_sft's curves."""
    step = trained_steps(ctx.input_manifests.get("model"))
    with scalar_writer(ctx.out) as writer:
        writer.add(evaluation_scalars(rates, guard_summary, suites), step)


def _load_suites(cfg: EvaluateConfig, inputs: dict[str, Path]) -> list[Any]:
    """The config's suites, their staged tasks read and checked (lm-eval is imported only when there are any)."""
    if not cfg.suites:
        return []
    from loraflow.steps import _suites

    return _suites.load(cfg, inputs)


def _sampling_params(cfg: EvaluateConfig) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=float(cfg.temperature),
        max_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        skip_special_tokens=True,
    )


def _check_prompts_fit(prompt_ids: list[list[int]], cfg: EvaluateConfig) -> None:
    """The longest prompt and its answer must fit the engine's context."""
    longest = max(len(p) for p in prompt_ids)
    if longest + cfg.max_new_tokens > cfg.max_model_len:
        raise LoraflowError(
            f"evaluate: the longest prompt has {longest} tokens; with max_new_tokens={cfg.max_new_tokens} it "
            f"exceeds max_model_len={cfg.max_model_len}: raise max_model_len"
        )


@dataclass
class _Generations:
    """vLLM's answers in example order: text, generated token count and finish reason of each."""

    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    seconds: float = 0.0  # generating all of them

    def add(self, outputs: Any) -> int:
        """Append one batch's outputs; return the tokens it generated."""
        ntok = 0
        for out in outputs:
            completion = out.outputs[0]
            self.texts.append(completion.text)
            self.tokens.append(len(completion.token_ids))
            self.finish.append(completion.finish_reason)
            ntok += len(completion.token_ids)
        return ntok

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds if self.seconds > 0 else 0.0


def _generate(
    ctx: StepContext, engine: Engine, sampling: Any, prompt_ids: list[list[int]], batch_size: int
) -> _Generations:
    """Generate for every prompt, ``batch_size`` at a time, logging each batch's throughput."""
    # Same seed, same batches, empty cache -> the same generations run after run.
    if hasattr(engine.llm, "reset_prefix_cache"):
        engine.llm.reset_prefix_cache()
    gen = _Generations()
    n_batches = (len(prompt_ids) + batch_size - 1) // batch_size
    started = time.monotonic()
    for b in range(n_batches):
        t0 = time.monotonic()
        batch = [{"prompt_token_ids": ids} for ids in prompt_ids[b * batch_size : (b + 1) * batch_size]]
        ntok = gen.add(engine.llm.generate(batch, sampling, use_tqdm=False))
        dt = time.monotonic() - t0
        ctx.progress(
            f"batch {b + 1}/{n_batches}: {len(gen.texts)}/{len(prompt_ids)} examples, "
            f"{ntok} tokens in {dt:.2f}s ({ntok / dt if dt > 0 else 0.0:.0f} tok/s)"
        )
    gen.seconds = time.monotonic() - started
    return gen


def _timing(engine: Engine, gen: _Generations, prompt_ids: list[list[int]]) -> dict[str, Any]:
    return {
        "startup_s": round(engine.startup_s, 3),
        "import_s": round(engine.import_s, 3),
        "generate_s": round(gen.seconds, 3),
        "generated_tokens": gen.total_tokens,
        "prompt_tokens": sum(len(p) for p in prompt_ids),
        "tokens_per_s": round(gen.tokens_per_s, 1),
    }


def _metrics_report(
    stage: str,
    cfg: EvaluateConfig,
    engine: Engine,
    examples: list[Example],
    metrics: dict[str, Any],
    chosen: Sequence[metric_table.Metric],
    timing: dict[str, Any],
) -> dict[str, Any]:
    """metrics.json, less its ``files``: the scores, the per-example lists, timings and settings (the scoring
    settings once, in ``config``, as the stage ran them)."""
    return {
        "stage": stage,
        **{m.name: metrics[m.name] for m in chosen},
        "n": metrics["n"],
        **{f"n_{m.column}": metrics[f"n_{m.column}"] for m in chosen},
        "ids": [ex.id for ex in examples],
        **{m.column: metrics[m.column] for m in chosen},
        "timing": timing,
        "config": cfg.model_dump(mode="json"),
        "engine": {k: v for k, v in engine.kwargs.items() if k not in ("model", "tokenizer")},
        "device": engine.device,
        "vllm_version": engine.vllm_version,
    }


def _write_predictions(
    out: Path,
    examples: list[Example],
    texts: list[str],
    generations: list[str],
    scored: list[metric_table.ScoredExample],
    gen_tokens: list[int],
    finish: list[str | None],
) -> list[str]:
    import pandas as pd

    df = pd.DataFrame(
        {
            "id": [ex.id for ex in examples],
            "prompt": texts,
            "reference": [ex.reference for ex in examples],
            "generation": generations,
            "answer": [s.answer for s in scored],
            **{column: [s.outcomes[column] for s in scored] for column in scored[0].outcomes},
            "generated_tokens": gen_tokens,
            "finish_reason": finish,
        }
    )
    df.to_json(out / PREDICTIONS_JSONL, orient="records", lines=True, force_ascii=False)
    written = [PREDICTIONS_JSONL]
    if importlib.util.find_spec("pyarrow") or importlib.util.find_spec("fastparquet"):
        df.to_parquet(out / PREDICTIONS_PARQUET, index=False)
        written.append(PREDICTIONS_PARQUET)
    return written


def run(ctx: StepContext) -> dict[str, Any]:
    """The step: load the model into vLLM, generate for the eval set, score, write predictions and metrics.

    The program ends right after (``exit_process``), so the engine is left to that end rather than
    torn down first (:meth:`Engine.leave_to_exit`); in a process that goes on, call :func:`evaluate`."""
    return evaluate(ctx, process_ends=True)


def stage_from_argv(argv: list[str]) -> str:
    """The stage label: the last path component of ``--output`` ("evaluate" when absent)."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--output" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--output="):
            value = arg.split("=", 1)[1]
        if value:
            last = value.rstrip("/").rsplit("/", 1)[-1]
            if last and not last.endswith(":"):
                return last
    return "evaluate"


if __name__ == "__main__":
    run_and_exit(stage_from_argv(sys.argv[1:]), run)
