"""What the ``vllm-tiny`` phase carries beside the tiny base (bench/tpu/README.md, "Serving"), made here in
the trainer env:

    .venvs/trainer/bin/python bench/tpu/prepare_serve.py

The tiny base (``.tpu-inputs/tiny``, as ``make tpu-prepare`` makes it) trained 150 steps on the parity task
with loraflow's lora_sft on this CPU (``_case.train``, the training phase's float32 configuration), its
PEFT adapter kept in ``.tpu-inputs/vllm/tiny-adapter`` and merged into the base by loraflow's merge (what
merge_adapter publishes) in ``.tpu-inputs/vllm/tiny-merged``: a model whose answers are right, so that
the chip's accuracy means something. About a minute.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(HERE)]

import _case  # noqa: E402

TINY = REPO / ".tpu-inputs" / "tiny"
DEST = REPO / ".tpu-inputs" / "vllm"
CASE = {"kind": "train", "size": "tiny", "mode": "loraflow", "dtype": "float32", "quantization": "none", "steps": 150}


def main() -> int:
    from loraflow.dev import tinymodel
    from loraflow.lora.merge import merge_checkpoint

    if not (TINY / "config.json").is_file():
        tinymodel.create(TINY, [_case.PARITY])
    root = Path(tempfile.mkdtemp(prefix="tpu-serve-prepare-"))
    _case.prepare("tiny", root, str(TINY))
    summary = _case.train(CASE, root)["summary"]
    peft = root / "runs" / _case.run_name(CASE) / "out" / "peft"
    shutil.rmtree(DEST, ignore_errors=True)
    shutil.copytree(peft, DEST / "tiny-adapter")
    merge_checkpoint(TINY, peft, DEST / "tiny-merged")
    shutil.rmtree(root)
    print(
        f"trained (loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}) and merged into {DEST / 'tiny-merged'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
