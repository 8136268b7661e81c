"""The host's time per batch of lora_sft's training data (trainer env), alone: the TPU check's 1.5 B case
(``bench/tpu/_case.py``: the parity set's 2,000 rows, 8 packed rows of 1,024 tokens a batch) through
loraflow's MaxText command line and MaxText's own SFT data pipeline (``create_data_iterator``, then
``DataLoader.load_next_batch`` as the trainer's data hook calls it: chat template, tokenizing, packing and
the batch's ``device_put``), on this machine's CPU. Prints each ``next()``'s seconds and their spread.

    .venvs/trainer/bin/python bench/data_host_time.py [--batches 30] [--prefetch N]

``--prefetch N``: the same batches through :mod:`loraflow.trainer.batches_ahead` with ``N`` ready ahead,
each ``next()`` after a sleep of ``--step`` seconds (a device step's stand-in): what the loop then waits.
``--workers 1``: MaxText's pipeline in grain's worker process, as lora_sft runs it on an accelerator
(default 0: in this process). ``loop_cpu_s`` is this process's CPU time over the batches: on a TPU host, the
time its Python holds the interpreter lock the training loop needs to dispatch steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
PARITY = REPO / "pipelines" / "data" / "parity" / "train.jsonl"


def _loader(root: Path, steps: int, workers: int = 0) -> object:
    from absl import flags
    from maxtext.common.data_loader import DataLoader
    from maxtext.configs import pyconfig
    from maxtext.input_pipeline import input_pipeline_interface
    from maxtext.utils import maxtext_utils

    from loraflow.dev import tinymodel
    from loraflow.spec.step_configs import LoraSftConfig, parse
    from loraflow.trainer.argv import sft_argv
    from loraflow.trainer.converted import ConvertedModel
    from loraflow.trainer.data import prepare, training_set

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    hf = root / "hf"
    tinymodel.create(hf, [PARITY])  # the TPU case's tokenizer (its model: tiny, never read here)
    data = root / "data"
    data.mkdir()
    with (data / "train.jsonl").open("w") as out:  # as bench/_sft_inputs.py writes the parity set
        for i, line in enumerate(PARITY.read_text().splitlines()):
            row = json.loads(line)
            messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
            out.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
    settings = {"steps": steps, "batch_size": 8, "max_length": 1024, "dtype": "bfloat16", "hardware": "cpu"}
    cfg = parse(LoraSftConfig, settings)
    model = ConvertedModel(tinymodel.MAXTEXT_MODEL, dict(tinymodel.MAXTEXT_OVERRIDES), True, "/nowhere")
    prepared = prepare(cfg, training_set(data), hf)
    mt_config = pyconfig.initialize_pydantic(
        sft_argv(cfg, model, prepared, hf, str(root / "maxtext"), data_workers=workers)
    )
    mesh = maxtext_utils.get_mesh_from_config(mt_config)
    iterator, _ = input_pipeline_interface.create_data_iterator(mt_config, mesh)
    return DataLoader(mt_config, mesh, iterator, goodput_recorder=None)


def _spread(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "mean": statistics.mean(seconds),
        "median": statistics.median(seconds),
        "min": ordered[0],
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--prefetch", type=int, default=0)
    parser.add_argument("--step", type=float, default=0.5, help="seconds a step takes (with --prefetch)")
    parser.add_argument("--workers", type=int, default=0, choices=(0, 1), help="grain worker processes")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from loraflow.trainer.batches_ahead import close_data_workers, prepare_batches_ahead

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        loader = _loader(Path(tmp), args.batches, args.workers)
        built = time.perf_counter() - t
        trainer = SimpleNamespace(data_hooks=SimpleNamespace(train_data_loader=loader))
        end_workers = close_data_workers(trainer)
        if args.prefetch:  # as lora_sft puts it under its trainer's data loader on an accelerator
            ahead = prepare_batches_ahead(trainer, print, args.prefetch, backend="tpu")
        load = loader.load_next_batch  # type: ignore[attr-defined]
        seconds, rows = [], []
        loop_cpu = time.process_time()
        for _ in range(args.batches):
            if args.prefetch:
                time.sleep(args.step)
            t = time.perf_counter()
            batch = load()
            seconds.append(time.perf_counter() - t)
            rows.append(int((batch["inputs_segmentation"] > 0).sum()))
        loop_cpu = time.process_time() - loop_cpu
        if args.prefetch:
            ahead.close()  # type: ignore[union-attr]
        end_workers()
        cpu = time.process_time()
    print(
        json.dumps(
            {
                "pipeline_built_s": round(built, 2),
                "prefetch": args.prefetch,
                "workers": args.workers,
                "step_s": args.step if args.prefetch else None,
                "next_s": [round(s, 4) for s in seconds],
                "tokens_per_batch": rows,
                "spread_s": {k: round(v, 4) for k, v in _spread(seconds[1:]).items()},  # after the first
                "process_cpu_s": round(cpu, 1),
                "loop_cpu_s": round(loop_cpu, 2),
                "load_average": os.getloadavg(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
