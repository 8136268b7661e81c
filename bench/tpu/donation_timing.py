"""Does donating the model stop the host running ahead of the chip? (issue 39 item 2)

Tunix's PeftTrainer trains a synthetic LoRA model (``--layers`` frozen ``--width`` x ``--width`` bf16
weights, each with a rank-16 LoRA pair; ``--rows`` rows a step) for ``--steps`` steps, its train step
jitted one of three ways:

* ``optimizer``: Tunix's own jit, the optimizer donated. nnx returns the whole model from the step, so
  XLA copies every frozen weight into a fresh output each step (one model of memory more).
* ``model``: loraflow's (:func:`loraflow.trainer.donation.donate_the_model`): the model donated too, the
  frozen weights returned written over themselves.
* ``unchanged``: ``nnx.jit(graph_updates=False)``, the optimizer donated: nnx returns only the
  variables the step changed (the LoRA pair, the optimizer), so the frozen weights are neither copied
  nor donated. nnx's cached graph does not work in this mode: the trainer runs without it.

Each step records: the seconds inside the train step's call (dispatch: a call that waits for the chip
shows here), the host's lead (when the call started minus when the previous step's loss was ready:
negative while the host runs ahead of the chip), and the gap between consecutive step ends. Step 0
(compile) is left out. One JSON line a mode on stdout::

    python3 bench/tpu/donation_timing.py [--modes optimizer,model,unchanged] [--layers 48] [--width 4096] [--rows 4096]

Runs anywhere JAX runs (on a CPU the chip's runtime is not what is measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _model(layers: int, width: int) -> Any:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, key: Any) -> None:
            self.w = nnx.Param(jax.random.normal(key, (width, width), jnp.bfloat16) / width**0.5)
            self.a = nnx.LoRAParam(jnp.zeros((width, 16), jnp.bfloat16))
            self.b = nnx.LoRAParam(jax.random.normal(key, (16, width), jnp.bfloat16) * 0.01)

        def __call__(self, h: Any) -> Any:
            return jnp.tanh(h @ self.w[...] + (h @ self.a[...]) @ self.b[...])

    class Model(nnx.Module):
        def __init__(self) -> None:
            self.layers = nnx.List([Layer(jax.random.PRNGKey(i)) for i in range(layers)])

        def __call__(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    return Model()


def run(mode: str, layers: int, width: int, rows: int, steps: int) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tunix.sft import peft_trainer

    from loraflow.trainer import donation

    model = _model(layers, width)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=steps)
    trainer = peft_trainer.PeftTrainer(model, optax.adam(1e-3), config)
    trainer = trainer.with_loss_fn(lambda m, x, y: jnp.mean((m(x) - y).astype(jnp.float32) ** 2))
    trainer = trainer.with_gen_model_input_fn(lambda b: b)
    if mode == "model":
        donation.donate_the_model(trainer, lambda line: None)
    jitted = trainer.jit_train_and_eval_step
    calls: list[tuple[float, float]] = []
    ends: dict[int, float] = {}

    def timed(skip_jit: bool = False, cache_nnx_graph: bool = False) -> Any:
        if mode == "unchanged":
            jit = nnx.jit

            def unchanged(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("donate_argnames") == donation.TUNIX_DONATED:
                    kwargs["graph_updates"] = False
                return jit(*args, **kwargs)

            nnx.jit = unchanged  # type: ignore[assignment]
            try:
                step, evaluate = jitted(skip_jit, False)
            finally:
                nnx.jit = jit  # type: ignore[assignment]
        else:
            step, evaluate = jitted(skip_jit, cache_nnx_graph)

        def call(*args: Any, **kwargs: Any) -> Any:
            index, started = len(calls), time.perf_counter()
            out = step(*args, **kwargs)
            calls.append((started, time.perf_counter() - started))

            def wait(loss: Any = out[0]) -> None:
                loss.block_until_ready()
                ends[index] = time.perf_counter()

            threading.Thread(target=wait, daemon=True).start()
            return out

        call.func = step.func  # type: ignore[attr-defined]  # Tunix reads the jit cache's size through it
        return call, evaluate

    trainer.jit_train_and_eval_step = timed
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, width)), jnp.bfloat16),
        "y": jnp.zeros((rows, width), jnp.bfloat16),
    }
    trainer.train([batch] * steps)
    while len(ends) < len(calls):
        time.sleep(0.01)
    done = [ends[i] for i in range(len(calls))]
    gaps = [b - a for a, b in itertools.pairwise(done[1:])]
    leads = [calls[i][0] - done[i - 1] for i in range(2, len(calls))]
    dispatch = [d for _, d in calls[1:]]
    return {
        "mode": mode,
        "layers": layers,
        "width": width,
        "rows": rows,
        "steps": steps,
        "gap_s": {
            "mean": statistics.mean(gaps),
            "median": statistics.median(gaps),
            "each": [round(g, 4) for g in gaps],
        },
        "dispatch_s": {"mean": statistics.mean(dispatch), "max": max(dispatch)},
        "host_lead_s": {"mean": statistics.mean(leads), "each": [round(x, 4) for x in leads]},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="optimizer,model,unchanged")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    for mode in args.modes.split(","):
        if mode not in ("optimizer", "model", "unchanged"):
            raise SystemExit(f"unknown mode {mode!r}: optimizer, model or unchanged")
        print(json.dumps(run(mode, args.layers, args.width, args.rows, args.steps)), flush=True)


if __name__ == "__main__":
    main()
