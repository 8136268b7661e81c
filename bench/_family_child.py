"""Child of family_bench.py (trainer env). argv[1] says which:

gen FAMILY OUT        a generated bf16 checkpoint of FAMILY's real HF architecture at family_bench.DIMS
                      (loraflow.dev.tinymodel, random bit patterns) in OUT/base, a rank-16 adapter on
                      every projection in OUT/adapter
convert FAMILY HF OUT loraflow.steps.convert_checkpoint.convert as the family's tiny model's MaxText model
                      with the checkpoint's dimensions as overrides (as the convert stage runs it)
(the merge is _merge_children.py's ``loraflow`` child)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit  # noqa: E402

sys.path.insert(0, str(REPO))
from loraflow.dev import tinymodel  # noqa: E402

RANK, ALPHA = 16, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gen(family: str, out: Path, dims: dict[str, int]) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    dims = {**tinymodel.tiny(family).dims, **dims}  # the family's own keys beyond the shared shape (Gemma 3's window)
    base = tinymodel.create(
        out / "base", [REPO / "pipelines/data/parity/train.jsonl"], 0, dims, dtype="bfloat16", family=family
    )
    rng = np.random.default_rng(0)
    lora = {}
    shapes = tinymodel.weight_shapes(dims, family)
    for name, (_, shape) in shapes.items():
        if name.removesuffix(".weight").rsplit(".", 1)[-1] in TARGETS:
            key = "base_model.model." + name.removesuffix(".weight")
            lora[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, shape[1]), np.float32) * 0.01).astype(np.float32)
            lora[f"{key}.lora_B.weight"] = (rng.standard_normal((shape[0], RANK), np.float32) * 0.01).astype(np.float32)
    (out / "adapter").mkdir(parents=True, exist_ok=True)
    save_file(lora, str(out / "adapter" / "adapter_model.safetensors"))
    (out / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS})
    )
    emit(
        {
            "parameters": sum(int(np.prod(s)) for _, s in shapes.values()),
            "bytes": (base / "model.safetensors").stat().st_size,
            "tensors": len(shapes),
            "tied_embeddings": tinymodel.tiny(family).tied_embeddings,
        }
    )


def convert(family: str, hf_dir: Path, out: Path) -> None:
    from loraflow.steps import convert_checkpoint

    entry = tinymodel.tiny(family)
    overrides = entry.family.maxtext_overrides(json.loads((hf_dir / "config.json").read_text()))
    t = time.perf_counter()
    facts = convert_checkpoint.convert(hf_dir, out, entry.maxtext_model, overrides, True, {}, "float32")
    emit({"ok": True, "convert_s": time.perf_counter() - t, "process_s": time.perf_counter() - T0, **facts})


if __name__ == "__main__":
    cmd, family, *rest = sys.argv[1:]
    if cmd == "gen":
        gen(family, Path(rest[0]), json.loads(rest[1]))
    else:
        convert(family, Path(rest[0]), Path(rest[1]))
