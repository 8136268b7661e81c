"""Children of merge_bench.py. argv[1] says which:

gen OUT LAYERS HIDDEN INTER VOCAB         (serving env: torch + safetensors) base checkpoint + adapter
loraflow BASE ADAPTER OUT                 (trainer env) loraflow.lora.merge.merge_checkpoint
naive BASE ADAPTER OUT                    (serving env) load every tensor, merge in torch, save_file
peft BASE ADAPTER OUT                     (serving env + PEFT on PYTHONPATH) merge_and_unload + save_pretrained
compare A B                               (serving env) tensor-by-tensor bit comparison
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARD = 500 * 1024 * 1024
RANK, ALPHA = 16, 32


def gen(out: Path, layers: int, hidden: int, inter: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file

    heads, kv, hd = hidden // 64, max(1, hidden // 512), 64
    base, adapter = out / "base", out / "adapter"
    base.mkdir(parents=True, exist_ok=True)
    adapter.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, std=0.02, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    shapes = {
        "self_attn.q_proj": (heads * hd, hidden),
        "self_attn.k_proj": (kv * hd, hidden),
        "self_attn.v_proj": (kv * hd, hidden),
        "self_attn.o_proj": (hidden, heads * hd),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shards: list[dict] = [{}]
    size = 0
    weight_map = {}
    lora = {}

    def put(name, t):
        nonlocal size
        nb = t.numel() * t.element_size()
        if size + nb > SHARD and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb

    put("model.embed_tokens.weight", rnd(vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}"
        put(f"{p}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))
        for mod, shp in shapes.items():
            put(f"{p}.{mod}.weight", rnd(*shp))
            lora[f"base_model.model.{p}.{mod}.lora_A.weight"] = rnd(RANK, shp[1], std=0.01, dtype=torch.float32)
            lora[f"base_model.model.{p}.{mod}.lora_B.weight"] = rnd(shp[0], RANK, std=0.01, dtype=torch.float32)
        put(f"{p}.post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    put("model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16))
    put("lm_head.weight", rnd(vocab, hidden))
    n = len(shards)
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(base / fname), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    (base / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    params = sum(t.numel() for s in shards for t in s.values())
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (base / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": ALPHA,
                "lora_dropout": 0.0,
                "target_modules": TARGETS,
                "bias": "none",
                "fan_in_fan_out": False,
                "use_rslora": False,
                "use_dora": False,
                "base_model_name_or_path": str(base),
                "modules_to_save": None,
            },
            indent=1,
        )
    )
    largest = max(t.numel() * t.element_size() for s in shards for t in s.values())
    emit(
        {
            "parameters": params,
            "bytes": total,
            "shards": n,
            "largest_tensor_bytes": largest,
            "adapter_parameters": sum(t.numel() for t in lora.values()),
        }
    )


def merge_loraflow(base: Path, adapter: Path, out: Path) -> None:
    from loraflow.lora.merge import merge_checkpoint

    t = time.perf_counter()
    rep = merge_checkpoint(base, adapter, out, shard_bytes=SHARD)
    emit({"inner_s": time.perf_counter() - t, **rep.summary()})


def merge_naive(base: Path, adapter: Path, out: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    t = time.perf_counter()
    sd = {}
    for f in sorted(base.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    merged = 0
    for key in [k for k in lora if ".lora_A." in k]:
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        a, b = lora[key].float(), lora[key.replace(".lora_A.", ".lora_B.")].float()
        w = sd[module + ".weight"]
        sd[module + ".weight"] = ((b @ a) * scale + w.float()).to(w.dtype)
        merged += 1
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [{}], 0
    for k, v in sd.items():
        nb = v.numel() * v.element_size()
        if size + nb > SHARD and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nb
    wm = {}
    for i, s in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, str(out / fname), metadata={"format": "pt"})
        wm.update(dict.fromkeys(s, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    shutil.copy(base / "config.json", out / "config.json")
    emit({"inner_s": time.perf_counter() - t, "merged": merged})


def merge_peft(base: Path, adapter: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16, low_cpu_mem_usage=True)
    model = PeftModel.from_pretrained(model, str(adapter))
    merged = model.merge_and_unload()
    merged.save_pretrained(str(out), max_shard_size="500MB", safe_serialization=True)
    import peft
    import transformers

    emit({"inner_s": time.perf_counter() - t, "peft": peft.__version__, "transformers": transformers.__version__})


def compare(a: Path, b: Path) -> None:
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        m = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                m.update(dict.fromkeys(h.keys(), f))
        return m

    ia, ib = index(a), index(b)
    res = {
        "tensors_a": len(ia),
        "tensors_b": len(ib),
        "missing_in_b": sorted(set(ia) - set(ib))[:5],
        "extra_in_b": sorted(set(ib) - set(ia))[:5],
        "tensors_differing": 0,
        "elements_differing": 0,
        "elements": 0,
        "max_abs_diff": 0.0,
        "max_ulp_diff": 0,
    }
    for k in sorted(set(ia) & set(ib)):
        with safe_open(str(ia[k]), "pt") as ha, safe_open(str(ib[k]), "pt") as hb:
            x, y = ha.get_tensor(k), hb.get_tensor(k)
        res["elements"] += x.numel()
        if x.dtype != y.dtype or x.shape != y.shape:
            res["tensors_differing"] += 1
            res.setdefault("dtype_or_shape_mismatch", []).append(k)
            continue
        if torch.equal(
            x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
            y.view(torch.int16) if y.dtype == torch.bfloat16 else y,
        ):
            continue
        res["tensors_differing"] += 1
        diff = (x.float() - y.float()).abs()
        res["elements_differing"] += int((diff > 0).sum())
        res["max_abs_diff"] = max(res["max_abs_diff"], float(diff.max()))
        if x.dtype == torch.bfloat16:

            def ordered(t: torch.Tensor) -> torch.Tensor:  # bf16 bits on a monotone integer line (-0 = +0)
                v = t.view(torch.int16).int()
                return torch.where(v < 0, -32768 - v, v)

            ulp = (ordered(x) - ordered(y)).abs().max()
            res["max_ulp_diff"] = max(res["max_ulp_diff"], int(ulp))
    res["identical"] = res["tensors_differing"] == 0 and not res["missing_in_b"] and not res["extra_in_b"]
    emit(res)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "gen":
        gen(Path(args[0]), *map(int, args[1:]))
    elif cmd == "compare":
        compare(Path(args[0]), Path(args[1]))
    else:
        {"loraflow": merge_loraflow, "naive": merge_naive, "peft": merge_peft}[cmd](*map(Path, args))
