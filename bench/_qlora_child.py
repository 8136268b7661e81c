"""Child of qlora_bench.py (trainer env). argv: MODE ROOT [STEPS] [QUANTIZATION]

prepare  make a ~100 M parameter Llama-architecture checkpoint (loraflow.dev.tinymodel with DIMS
         below: the targeted projections dominate, as in a real LLM), convert it (loraflow's convert) into
         ROOT/ckpt and write ROOT/data/train.jsonl (the parity set as chat messages)
train    the lora_sft stage function with ``lora.quantization`` QUANTIZATION (none = LoRA), tile 64,
         STEPS steps; reports its summary: training state bytes (model, adapter, optimizer; measured
         on the device), losses, seconds
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _sft_inputs import PARITY, prepare_sft_inputs  # noqa: E402
from common import emit  # noqa: E402

from loraflow.dev import tinymodel  # noqa: E402
from loraflow.models import llama  # noqa: E402

# ~106 M parameters: 7 layers of 1024-wide attention (16 query heads, 4 KV heads of 64) and a 4096-wide
# MLP; a 512-token vocabulary keeps the embeddings (not quantized) a small share, as in an 8B model.
DIMS = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 7,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 512,
}
OVERRIDES = llama.maxtext_overrides(DIMS)
CONFIG = {
    "model_name": tinymodel.MAXTEXT_MODEL,
    "model_overrides": OVERRIDES,
    "rank": 16,
    "alpha": 32.0,
    "batch_size": 8,
    "learning_rate": 0.001,
    "max_length": 64,
    "seed": 0,
    "checkpoint_period": 1000,
    "dtype": "float32",
    "quantized_eval_examples": 0,  # the benchmark measures training, not the trained model's answers
}


def parameters() -> int:
    d, f, v, layers = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"], DIMS["num_hidden_layers"]
    q = DIMS["num_attention_heads"] * DIMS["head_dim"]
    kv = DIMS["num_key_value_heads"] * DIMS["head_dim"]
    return 2 * v * d + d + layers * (2 * d + d * q + 2 * d * kv + q * d + 3 * d * f)


def prepare(root: Path) -> dict:
    hf = tinymodel.create(root / "hf", [PARITY], dims=DIMS)
    prepare_sft_inputs(root, hf, tinymodel.MAXTEXT_MODEL, OVERRIDES)
    return {"parameters": parameters(), "dims": DIMS}


def train(root: Path, steps: int, quantization: str) -> dict:
    from loraflow.steps import lora_sft
    from loraflow.steps._harness import StepContext

    out = root / f"out-{quantization}"
    (out / "out").mkdir(parents=True)
    (out / "work").mkdir(parents=True)
    config = {**CONFIG, "steps": steps, "quantization": quantization}
    if quantization != "none":
        config["tile_size"] = 64
    ctx = StepContext(
        stage="lora_sft",
        output_uri=str(out / "remote"),
        inputs={"checkpoint": root / "ckpt", "dataset": root / "data", "tokenizer": root / "hf"},
        input_manifests={},
        out=out / "out",
        work=out / "work",
        config=config,
    )
    s = lora_sft.run(ctx)
    keys = (
        "train_state_bytes",
        "model_bytes",
        "adapter_bytes",
        "optimizer_bytes",
        "step_argument_bytes",
        "step_temp_bytes",
        "first_loss",
        "final_loss",
    )
    return {k: s[k] for k in keys} | {"train_s": s["train_seconds"], "setup_s": s["setup_seconds"], "steps": steps}


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    result = prepare(root) if mode == "prepare" else train(root, int(sys.argv[3]), sys.argv[4])
    emit(result | {"wall_s": time.perf_counter() - T0})
