"""One measured case of the TPU check, in a process of its own (the chip's peak memory is per process,
and one process at a time can hold the chip). Run by ``bench/tpu/check.py``; argv: one JSON object.

``{"kind": "matmul"}``
    the chip's bf16 matrix-product rate: an 8192 x 8192 x 8192 product, ten times, wall clock.
``{"kind": "prepare", "size": S, "root": DIR[, "hf": HF_DIR]}``
    the HF checkpoint of size ``S`` (``SIZES``; generated, or ``hf`` when given), converted by loraflow's
    convert_checkpoint stage function into ``DIR/ckpt``, JAX on the host's CPU; the parity training set
    as chat messages in ``DIR/data``.
``{"kind": "train", "size": S, "root": DIR, "mode": "loraflow"|"maxtext", "dtype": D, "quantization": Q, "steps": N}``
    ``loraflow``: the lora_sft stage function (``loraflow.steps.lora_sft.run``: loraflow's MaxText
    arguments, hooks, checkpoints, adapter and PEFT export); ``maxtext``: MaxText's own SFT entry
    points (``setup_trainer_state``, ``train_model``) with the same MaxText arguments, nothing of
    loraflow's around them. Both time every step the same way (the gap between consecutive step ends,
    read in MaxText's own ``on_train_step_end`` hook) and report the chip's peak memory.

Prints ``BENCH_JSON {...}`` last.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
PARITY = REPO / "pipelines" / "data" / "parity" / "train.jsonl"

from loraflow.dev import tinymodel  # noqa: E402  (stdlib and the model's dimensions only)

# Llama 3.x shapes (HF config keys). tiny: loraflow.dev.tinymodel's; 1b, 3b, 8b: Llama-3.2-1B,
# Llama-3.2-3B and Llama-3.1-8B's blocks and vocabulary, untied embeddings.
LLAMA_VOCAB = 128256
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(tinymodel.DIMS),
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": LLAMA_VOCAB,
    },
    "3b": {
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": LLAMA_VOCAB,
    },
    "6b": {  # 8B's layers, 24 of them: where one chip's limit lies
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": LLAMA_VOCAB,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": LLAMA_VOCAB,
    },
}
# Training per size: the tiny model learns the parity task (the CPU tests' configuration); the larger
# ones train 8 packed rows of 1,024 tokens a step (8,192 tokens), rank 16 on all seven projections.
TRAINING: dict[str, dict[str, Any]] = {
    "tiny": {"batch_size": 8, "max_length": 64, "learning_rate": 3e-3, "checkpoint_period": 50},
    "large": {"batch_size": 8, "max_length": 1024, "learning_rate": 1e-4, "checkpoint_period": 100000},
}
LORA = {"rank": 16, "alpha": 32.0, "seed": 0, "quantized_eval_examples": 0}
TILE = 64  # QLoRA's quantization tile: divides every contracted dimension of every size


def emit(data: dict[str, Any]) -> None:
    print("BENCH_JSON " + json.dumps(data, default=str), flush=True)


def parameters(dims: dict[str, int]) -> dict[str, int]:
    """Parameter counts: all, the linear layers' (their matmuls are the FLOPs: the 7 projections and the
    LM head; not the embedding lookup), the LoRA factors' at ``LORA['rank']`` on the 7 projections."""
    d, f, v, n = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"], dims["num_hidden_layers"]
    q, kv, r = (
        dims["num_attention_heads"] * dims["head_dim"],
        dims["num_key_value_heads"] * dims["head_dim"],
        LORA["rank"],
    )
    projections = n * (2 * d * q + 2 * d * kv + 3 * d * f)
    lora = n * r * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + f) + (f + d))
    return {"total": projections + 2 * v * d + n * 2 * d + d, "linear": projections + v * d, "lora": lora}


def model_flops_per_token(dims: dict[str, int], seq: int) -> dict[str, float]:
    """FLOPs one trained token costs under LoRA, counted from the model (not from what XLA runs).

    Frozen weights get no weight gradient, so a linear layer costs 2 FLOPs per parameter forward and 2
    backward (the activation gradient), not 6 as in full fine-tuning; the LoRA factors cost the usual 6.
    Attention's score and value products: 4 * seq * heads * head_dim per layer forward, halved for the
    causal mask, and twice that backward. Rematerialisation (MaxText recomputes activations in the
    backward pass) is work the chip does but not model FLOPs: ``with_remat`` adds one more forward.
    """
    p = parameters(dims)
    attn_fwd = dims["num_hidden_layers"] * 4 * seq * dims["num_attention_heads"] * dims["head_dim"] / 2
    model = 4 * p["linear"] + 6 * p["lora"] + 3 * attn_fwd
    return {
        "lora_model": model,
        "with_remat": model + 2 * p["linear"] + attn_fwd,
        "full_ft": 6 * p["linear"] + 3 * attn_fwd,
    }


def device_facts() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    facts: dict[str, Any] = {
        "backend": jax.default_backend(),
        "device_kind": dev.device_kind,
        "devices": jax.device_count(),
    }
    facts["jax"] = jax.__version__
    try:
        import jaxlib

        facts["jaxlib"] = jaxlib.__version__
    except Exception:  # a fact we only record
        pass
    try:
        from importlib.metadata import version

        facts["libtpu"] = version("libtpu")
    except Exception:  # a fact we only record
        facts["libtpu"] = None
    return facts


# A TPU reserves each loaded program's temporaries (XLA's temp_size) apart from the arrays it allocates:
# they show in bytes_reserved, not in bytes_in_use. The chip's memory in use is the sum of both.
MEMORY_BY_STEP = ("bytes_in_use", "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved")


def peak_memory() -> dict[str, Any]:
    """The chip's memory figures (MEMORY_BY_STEP) and its limit."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("bytes_limit", *MEMORY_BY_STEP)}


# ------------------------------------------------------------------------------------ cases


def matmul() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.default_backend() != "cpu" else 1024  # a CPU rehearsal only checks the code runs
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - t)
    flops = 2 * n**3
    return {
        "n": n,
        "seconds": times,
        "tflops_mean": flops / statistics.mean(times) / 1e12,
        "tflops_best": flops / min(times) / 1e12,
    }


def prepare(size: str, root: Path, hf: str | None, weights: bool = True) -> dict[str, Any]:
    from _sft_inputs import prepare_sft_inputs

    from loraflow.models import llama

    dims = SIZES[size]
    hf_dir = Path(hf) if hf else root / "hf"
    if not weights:
        return _random_init(size, root, hf_dir)
    t = time.perf_counter()
    if not hf:
        tinymodel.create(hf_dir, [PARITY], dims=dims, dtype="float32" if size == "tiny" else "bfloat16")
    generated = time.perf_counter() - t
    save_dtype = "float32" if size == "tiny" else "bfloat16"
    t = time.perf_counter()
    prepare_sft_inputs(root, hf_dir, tinymodel.MAXTEXT_MODEL, llama.maxtext_overrides(dims), save_dtype)
    converted = time.perf_counter() - t
    if not hf and size != "tiny":  # training reads the converted checkpoint: free the machine's disk
        for weights_file in hf_dir.glob("*.safetensors"):
            weights_file.unlink()
    (root / "hf_dir").write_text(str(hf_dir))
    return {"generate_s": generated, "convert_s": converted, "parameters": parameters(dims), **_disk(root)}


def _disk(root: Path) -> dict[str, Any]:
    import shutil

    usage = shutil.disk_usage(root)
    return {"disk_free_gib": usage.free / 2**30, "disk_total_gib": usage.total / 2**30}


def _random_init(size: str, root: Path, hf_dir: Path) -> dict[str, Any]:
    """No checkpoint: the tokenizer and the training data, and a checkpoint record whose weights MaxText
    initialises at random (``"init": "random"`` training cases). For the sizes whose question is whether
    MaxText can build the model on the chip at all: it builds it before it reads any checkpoint."""
    from _sft_inputs import prepare_sft_inputs

    from loraflow.models import llama

    tinymodel.create(hf_dir, [PARITY])  # the tokenizer (and a tiny model nobody reads)
    (hf_dir / "config.json").write_text(json.dumps(tinymodel.hf_config(SIZES[size], "bfloat16"), indent=2))
    overrides = llama.maxtext_overrides(SIZES[size])
    prepare_sft_inputs(root, hf_dir, tinymodel.MAXTEXT_MODEL, overrides, "bfloat16", convert=False)
    (root / "hf_dir").write_text(str(hf_dir))
    return {"parameters": parameters(SIZES[size]), "init": "random"}


def _step_clock(ends: list[float], memory: list[list[int]], record_memory: bool) -> None:
    """MaxText's SFT hooks, with each step's end time read into ``ends`` (the same clock for both modes:
    loraflow's hooks subclass whatever ``SFTTrainingHooks`` is when the stage builds its trainer) and the
    chip's memory then into ``memory`` (``MEMORY_BY_STEP``) where ``record_memory``. Reading the chip's memory
    waits for the steps queued on it (1.5 B LoRA: 0.58 s a step became 0.8-1.25 s), so a case that records it
    runs its steps one at a time, and only the ``memory`` phase's cases do."""
    import jax
    from maxtext.trainers.post_train.sft import hooks as sft_hooks

    base = sft_hooks.SFTTrainingHooks

    class Clocked(base):  # type: ignore[misc, valid-type]
        def on_train_step_end(self, *args: Any, **kwargs: Any) -> Any:
            out = super().on_train_step_end(*args, **kwargs)
            ends.append(time.perf_counter())
            if record_memory:
                stats = jax.devices()[0].memory_stats() or {}
                memory.append([int(stats.get(k, 0)) for k in MEMORY_BY_STEP])
            return out

    sft_hooks.SFTTrainingHooks = Clocked


def _inflight(steps: int) -> None:
    """At most ``steps`` train steps queued on the chip (Tunix's ``max_inflight_computations``, 2 unless
    MaxText's config says otherwise), for both modes: MaxText's set-up reads its Tunix config here."""
    import dataclasses

    from maxtext.trainers.post_train.sft import train_sft

    made = train_sft.get_tunix_config
    train_sft.get_tunix_config = lambda config: dataclasses.replace(made(config), max_inflight_computations=steps)


def _own_compile_cache(folder: Path) -> None:
    """Point MaxText's persistent compilation cache (``jax_cache_dir``, shared across processes by
    default) at a folder of this case's own: every case compiles from nothing, whatever ran before it,
    so compile times and stage walls compare between cases in any order."""
    from jax.experimental.compilation_cache import compilation_cache

    set_dir = compilation_cache.set_cache_dir
    compilation_cache.set_cache_dir = lambda _path: set_dir(str(folder))  # MaxText's pyconfig calls this


def run_name(case: dict[str, Any]) -> str:
    queued = f"-inflight{case['inflight']}" if "inflight" in case else ""
    settings = "".join("-" + arg.replace("=", "_") for arg in case.get("maxtext", []))
    settings += "".join(f"-{key}_{value}" for key, value in case.get("config", {}).items())
    return f"{case['size']}-{case['mode']}-{case['dtype']}-{case['quantization']}-{case['steps']}{queued}{settings}"


def _append_maxtext_args(extra: list[str]) -> None:
    """MaxText ``key=value`` settings after the stage's own command line (a later value wins), in both modes."""
    from loraflow.trainer import training

    built = training.maxtext_argv
    training.maxtext_argv = lambda *args: [*built(*args), *extra]


def _context(root: Path, case: dict[str, Any], config: dict[str, Any]) -> Any:
    from loraflow.steps._harness import StepContext

    out = root / "runs" / run_name(case)
    if out.exists():  # the same case run again on a warm machine: from nothing, as the first time
        shutil.rmtree(out)
    for sub in ("out", "work"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    hf_dir = Path((root / "hf_dir").read_text())
    inputs = {"checkpoint": root / "ckpt", "dataset": root / "data", "tokenizer": hf_dir}
    return StepContext("lora_sft", str(out / "remote"), inputs, {}, out / "out", out / "work", config)


def train(case: dict[str, Any], root: Path) -> dict[str, Any]:
    size = case["size"]
    config = {
        **LORA,
        **TRAINING["tiny" if size == "tiny" else "large"],
        "steps": case["steps"],
        "dtype": case["dtype"],
        "quantization": case["quantization"],
        "tile_size": TILE if case["quantization"] != "none" else None,
        **case.get("config", {}),  # lora_sft settings of the case's own (e.g. training.tuning)
    }
    ctx = _context(root, case, config)
    _own_compile_cache(root / "runs" / run_name(case) / "jax_cache")
    ends: list[float] = []
    memory: list[list[int]] = []
    _step_clock(ends, memory, bool(case.get("memory_by_step")))
    if "inflight" in case:
        _inflight(int(case["inflight"]))
    if case.get("maxtext"):
        _append_maxtext_args(list(case["maxtext"]))
    t = time.perf_counter()
    said: list[tuple[float, str, int | None]] = []  # when the stage said what (and the chip's peak then)
    say = ctx.progress

    def timed(message: str) -> None:  # with the chip's peak so far: a call cut short still shows it
        peak = peak_memory()["peak_bytes_in_use"]
        said.append((round(time.perf_counter() - t, 2), message[:100], peak))
        say(f"{message} [peak {peak / 2**30:.2f} GiB]" if peak else message)

    ctx.progress = timed
    if case["mode"] == "loraflow":
        from loraflow.steps import lora_sft

        summary = lora_sft.run(ctx)
        result: dict[str, Any] = {"summary": summary, "out": str(ctx.out)}
    else:
        from _sft_inputs import maxtext_sft_direct

        result = {"summary": maxtext_sft_direct(ctx, case.get("init") == "random")}
    done = time.perf_counter()
    result["stage_s"] = done - t
    result["progress_s"] = said
    if ends:  # where the stage's wall goes: set-up through the first (compiling) step, steps, outputs
        result |= {"to_first_step_s": ends[0] - t, "steps_s": ends[-1] - ends[0], "after_last_step_s": done - ends[-1]}
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    seq = config["max_length"]
    tokens = config["batch_size"] * seq
    result |= {
        "config": config,
        "steps_timed": len(gaps),
        "step_s_median": statistics.median(gaps) if gaps else None,
        "step_s_mean": statistics.mean(gaps) if gaps else None,
        "step_s_all": [round(g, 5) for g in gaps],
        "memory_by_step": memory,  # per step end: MEMORY_BY_STEP
        "tokens_per_step": tokens,
        "flops_per_token": model_flops_per_token(SIZES[size], seq),
        "parameters": parameters(SIZES[size]),
        **peak_memory(),
    }
    if gaps:  # the median picks the fast half where step gaps alternate: the mean beside it
        result["tokens_per_s"] = tokens / result["step_s_median"]
        result["tokens_per_s_mean"] = tokens / result["step_s_mean"]
    return result


def main() -> None:
    case = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res: dict[str, Any] = {"case": case}
    if case["kind"] == "matmul":
        res |= matmul()
    elif case["kind"] == "prepare":
        res |= prepare(case["size"], Path(case["root"]), case.get("hf"), case.get("weights", True))
    else:
        res |= train(case, Path(case["root"]))
    res["device"] = device_facts()
    res["process_s"] = time.perf_counter() - T0
    emit(res)


if __name__ == "__main__":
    main()
