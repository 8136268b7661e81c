"""Child of convert_bench.py (trainer env). argv: MODE HF_DIR OUT_DIR

loraflow      loraflow.steps.convert_checkpoint.convert (lazy loader + materialising save)
direct-eager  maxtext to_maxtext.main(lazy_load_tensors=False) as documented, the HF config registered
              under the model key (without it MaxText uses the real 8B shapes); its safetensors
              loader asks for framework="pt" (torch is not in the trainer env): patched to "np"
direct-lazy   maxtext to_maxtext.main(lazy_load_tensors=True), no patch (Orbax refuses LazyTensor leaves)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

from loraflow.models import llama  # noqa: E402

MODEL = "llama3.1-8b"  # the MaxText key; the checkpoint's own dimensions are passed as overrides

if __name__ == "__main__":
    mode, hf_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    from loraflow.steps import convert_checkpoint as cc
    from loraflow.trainer.argv import overrides_args

    OVERRIDES = llama.maxtext_overrides(json.loads((hf_dir / "config.json").read_text()))
    t = time.perf_counter()
    res: dict = {"mode": mode}
    try:
        if mode == "loraflow":
            facts = cc.convert(hf_dir, out, MODEL, OVERRIDES, True, {}, "float32")
            res["parameters"] = facts.get("parameters")
        else:
            from maxtext.checkpoint_conversion import to_maxtext

            cc.register_hf_config(MODEL, hf_dir)
            args = [
                "to_maxtext",
                *overrides_args(MODEL, OVERRIDES),
                "hardware=cpu",
                "skip_jax_distributed_system=true",
                "attention=dot_product",
                "scan_layers=true",
                f"base_output_directory={out / 'maxtext'}",
                "run_name=convert",
                "checkpoint_storage_use_ocdbt=true",
                "checkpoint_storage_use_zarr3=true",
            ]
            if mode == "direct-eager":
                original = to_maxtext.load_hf_dict_from_safetensors

                def np_loader(*a, **kw):
                    kw["framework"] = "np"
                    return original(*a, **kw)

                to_maxtext.load_hf_dict_from_safetensors = np_loader
            to_maxtext.main(
                args,
                lazy_load_tensors=(mode == "direct-lazy"),
                hf_model_path=str(hf_dir),
                save_dtype="float32",
                simulated_cpu_devices_count=1,
            )
        res["ok"] = (out / "maxtext" / "0" / "items").is_dir()
    except BaseException as exc:
        res["ok"] = False
        res["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    res["convert_s"] = time.perf_counter() - t
    res["process_s"] = time.perf_counter() - T0
    emit(res)
