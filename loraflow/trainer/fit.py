"""Will it fit? lora_sft's peak memory per TPU chip, predicted on a machine with no chip.

MaxText's own ahead-of-time route (``maxtext/trainers/pre_train/train_compile.py``): libtpu describes the
slice's chips (``jax.experimental.topologies``) without any being there, and XLA compiles for them. Here
the program compiled is lora_sft's own train step: MaxText's config from the spec's training and LoRA
settings (:mod:`loraflow.trainer.argv`), the model built as shapes only (MaxText's abstract model, LoRA
or QLoRA applied under ``nnx.eval_shape`` as the QLoRA host build does), the optimizer MaxText's SFT
set-up chooses, Tunix's step function jitted as the stage jits it (:mod:`loraflow.trainer.donation`: the
model and the optimizer donated). No weight is allocated: an 8B model compiles in about 2 GiB of host memory.

The predicted peak is the larger of the step's and the set-up's:

* the step's: XLA's own peak of the compiled program (its arguments, the outputs not aliased to a
  donated argument, and its temporaries: ``peak_memory_in_bytes`` of its memory analysis). On a TPU the
  temporaries are reserved for the loaded program apart from the arrays (the chip's ``bytes_reserved``,
  not its ``bytes_in_use``): the chip's memory in use is the sum of both, and that is what is predicted;
* the set-up's: MaxText's SFT set-up builds the model in the weight dtype on the chips before LoRA is
  applied (and QLoRA quantizes only then), so the full-precision model plus what LoRA adds; with QLoRA
  on one chip the model is built in host memory and the chip holds the quantized state and, while it is
  placed, one more copy of its largest array (:mod:`loraflow.trainer.host_build`).

``python -m loraflow.trainer.fit --config-json CFG --machine-type ct5lp-hightpu-1t --topology 1x1`` prints
the prediction as JSON (what ``loraflow plan --fit`` runs in this environment); :mod:`loraflow.spec.fit` holds the
arithmetic of fitting and the slices.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.spec import fit as rule
from loraflow.spec import tuning as tuning_rules
from loraflow.spec.step_configs import LoraSftConfig, parse
from loraflow.trainer import argv as mt_argv
from loraflow.trainer import donation

# compiles after the line's two: its candidate, the row on the other side of the chip's memory, and two
# more for a line that was a row or two off (loraflow.spec.fit.largest_fitting)
SEARCH_COMPILES = 4
# libtpu, loaded only to describe chips, not to own them: several predictions may run at once (its
# lock file is for processes that use a chip), and its start-up warnings about a TPU host's
# metadata (TPU_WORKER_HOSTNAMES, the accelerator type) do not apply.
LIBTPU_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}


@dataclass(frozen=True)
class StepPeak:
    """XLA's memory analysis of the compiled train step, per chip."""

    argument_bytes: int  # the model, the optimizer's state, the batch
    output_bytes: int
    alias_bytes: int  # outputs written over donated arguments (the model and the optimizer's state)
    temp_bytes: int  # activations, gradients, scratch
    # the program's peak in the chip's memory (:func:`step_figures`: XLA's peak_memory_in_bytes, with liveness;
    # where the analysis lacks it or the program offloads to the host, arguments + outputs - aliased + temporaries)
    peak_bytes: int
    # False: XLA refused to compile the step, its temporaries alone over the chip's memory (the figures
    # are then its temporaries as XLA's refusal states them and the rest counted from the shapes)
    compiled: bool = True
    # what the step keeps in the host's memory per chip (a remat policy that offloads); not in peak_bytes
    host_bytes: int = 0


# XLA's compile-time refusal: "... the total memory required for HLO temporaries (21.01G) exceeds ..."
_HBM_OOM = re.compile(r"memory required for HLO temporaries \(([0-9.]+)([KMGT])\)")


@dataclass(frozen=True)
class Prediction:
    per_device_batch: float
    step: StepPeak
    state_bytes: int  # the trained model's state per chip: base weights (quantized or not), adapter, optimizer
    setup_bytes: int  # the set-up's peak per chip
    peak_bytes: int  # max(step, set-up): what must fit
    queued_bytes: int  # with a second step queued, where there is room (loraflow.spec.fit.queued_peak)


def _bits(dtype: Any) -> int:
    """Bits per element where the array lives: 4-bit types are packed two to a byte on a TPU."""
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # a key of JAX's default PRNG: two uint32
        return 64
    name = np.dtype(dtype).name
    return 4 if name in ("int4", "uint4", "float4_e2m1fn") else np.dtype(dtype).itemsize * 8


def _per_chip(tree: Any) -> int:
    """Bytes per chip of a tree of shapes with shardings (one shard of each array)."""
    import math

    import jax

    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shard = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += (math.prod(shard) * _bits(leaf.dtype) + 7) // 8
    return total


def maxtext_config(
    cfg: LoraSftConfig,
    slice_name: str,
    chips: int,
    per_device_batch: float,
    work: str,
    remat_policy: str | None = None,
) -> Any:
    """MaxText's config of lora_sft's run, for ``per_device_batch`` rows per chip on the slice
    ``slice_name`` (MaxText's compile_topology, e.g. v5e-1): the spec's model, training and LoRA settings
    (and ``remat_policy``, as :func:`loraflow.trainer.argv.training_args` gives it to the stage), no data
    or checkpoint (shapes only)."""
    if not cfg.model_name:
        raise LoraflowError("lora_sft's config names no model (base_model.maxtext_model); the prediction needs one")
    batch = cfg.model_copy(update={"batch_size": max(1, round(per_device_batch * chips))})
    return _config(
        [
            *mt_argv.overrides_args(cfg.model_name, dict(cfg.model_overrides or {})),
            "hardware=tpu",
            "skip_jax_distributed_system=true",
            "scan_layers=true",  # convert_checkpoint's layout (ConvertCheckpointConfig.scan_layers)
            f"compile_topology={slice_name}",
            "compile_topology_num_slices=1",
            *mt_argv.training_args(batch, devices=chips, remat_policy=remat_policy),  # the stage's own settings
            "jax_cache_dir=",  # no persistent compilation cache: these programs are for chips that are not here
        ],
        work,
    )


def present_config(
    cfg: LoraSftConfig, model_name: str, overrides: dict[str, Any], scan_layers: bool, work: str, remat_policy: str
) -> Any:
    """MaxText's config of lora_sft's run on the devices JAX has here (the stage's own, before its set-up:
    :mod:`loraflow.trainer.tuning`): the converted model, the stage's hardware, compilation cache and
    training settings (:func:`loraflow.trainer.argv.training_args`) with ``remat_policy``; shapes only."""
    return _config(
        [
            *mt_argv.overrides_args(model_name, overrides),
            *mt_argv.hardware_args(cfg.hardware),
            *mt_argv.compile_cache_args(),
            f"scan_layers={str(bool(scan_layers)).lower()}",
            *mt_argv.training_args(cfg, remat_policy=remat_policy),
        ],
        work,
    )


def _config(settings: list[str], work: str) -> Any:
    """MaxText's SFT config of ``settings``, writing nothing (no checkpoints, evaluation, metrics or HLO dumps)."""
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # type: ignore[attr-defined]

    from loraflow.trainer.maxtext_config import sft_config

    argv = [
        "lora_sft_fit",
        os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "sft.yml"),
        *settings,
        f"base_output_directory={work}",
        f"run_name={mt_argv.RUN_NAME}",
        "enable_checkpointing=false",
        "eval_interval=-1",
        "enable_goodput_recording=false",
        "monitor_goodput=false",
        "enable_tensorboard=false",
    ]
    return sft_config(argv)


def _sharded(state: Any, shardings: Any) -> Any:
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def abstract_trainer(config: Any, mesh: Any) -> tuple[Any, Any]:
    """(MaxText's SFT trainer over the abstract LoRA model and optimizer, the abstract model before LoRA)."""
    import jax
    import optax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from jax.sharding import NamedSharding
    from maxtext.optimizers import optimizers
    from maxtext.trainers.post_train.sft import train_sft
    from maxtext.utils import lora_utils, maxtext_utils, model_creation_utils, sharding

    create, base = model_creation_utils.create_nnx_abstract_model(config, mesh)
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        # mesh=None: traced arrays have no sharding to move (as the QLoRA host build applies it)
        lora = nnx.eval_shape(lambda: lora_utils.apply_lora_to_model(create(), None, config))
        graphdef, state = nnx.split(lora)
        model = nnx.merge(graphdef, _sharded(state, sharding.nnx_construct_named_sharding(state, mesh)))
        # setup_trainer_state's optimizer, schedule and clipping
        tx = optimizers.get_optimizer(config, maxtext_utils.create_learning_rate_schedule(config), model)
        if config.gradient_clipping_threshold > 0:
            tx = optax.chain(optax.clip_by_global_norm(max_norm=config.gradient_clipping_threshold), tx)
        optimizer_class = nnx.Optimizer

        def abstract_optimizer(model: Any, tx: Any, *, wrt: Any) -> Any:
            # Tunix makes the optimizer from the model: here as shapes, sharded as Tunix shards it
            made = nnx.eval_shape(lambda m: optimizer_class(m, tx, wrt=wrt), model)
            graph, opt_state = nnx.split(made)
            specs = nnx.get_partition_spec(opt_state)
            shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), specs)
            return nnx.merge(graph, _sharded(opt_state, shardings))

        nnx.Optimizer = abstract_optimizer  # type: ignore[misc]
        # This trainer only compiles the step: no checkpoint manager (Orbax's, over a folder the prediction
        # deletes) and no metrics logger. Tunix's registers its TensorBoard writer with jax.monitoring, and
        # left so, in a process that then trains (tuning: auto), the writer and its two threads lived on and
        # got every scalar the stage's own trainer logged.
        quiet = replace(
            train_sft.get_tunix_config(config), checkpoint_root_directory=None, metrics_logging_options=None
        )
        try:
            trainer = train_sft.MaxTextPeftTrainer(model, tx, quiet)
        finally:
            nnx.Optimizer = optimizer_class  # type: ignore[misc]
        trainer = train_sft.use_maxtext_loss_function(trainer, config)
    return trainer, base


def step_peak(trainer: Any, config: Any, mesh: Any) -> StepPeak:
    """The stage's train step (:func:`loraflow.trainer.donation.jit_train_step`) compiled for the slice on a
    batch of shapes sharded as Tunix shards each batch; XLA's memory analysis of it."""
    import jax
    from flax.core.spmd import logical_axis_rules
    from jax.sharding import NamedSharding, PartitionSpec
    from maxtext.utils import maxtext_utils

    batch = maxtext_utils.get_shaped_batch(
        config, batch_sharding=NamedSharding(mesh, PartitionSpec(*trainer.config.data_sharding_axis))
    )
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        lowered = donation.jit_train_step(trainer).lower(trainer.model, trainer.optimizer, batch)
        try:
            stats = lowered.compile().memory_analysis()
        except jax.errors.JaxRuntimeError as exc:
            refused = _HBM_OOM.search(str(exc))
            if refused is None:
                raise
            temp = int(float(refused.group(1)) * 1024 ** " KMGT".index(refused.group(2)))
            return _uncompiled(trainer, batch, temp)
    if stats is None:
        raise LoraflowError("XLA gave no memory analysis for the compiled step (libtpu too old?)")
    return step_figures(stats)


def step_figures(stats: Any) -> StepPeak:
    """The compiled step's figures from XLA's memory analysis, and its peak in the chip's own memory: its
    ``peak_memory_in_bytes`` (with liveness); but where the program keeps anything in the host's memory
    (a remat policy that offloads, ``remat_policy=minimal_offloaded`` or ``custom``), that figure counts the
    host's bytes too (8B nf4 offloading the MLP's wi: 21.1 GB, of which 15.0 on the host), so the chip's own
    arguments, outputs not written over a donated argument and temporaries are summed instead."""
    arguments, outputs = int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes)
    alias, temp = int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)
    summed = arguments + outputs - alias + temp
    on_host = sum(int(getattr(stats, f"host_{kind}_size_in_bytes", 0) or 0) for kind in ("argument", "output", "temp"))
    peak = summed if on_host else int(getattr(stats, "peak_memory_in_bytes", 0) or summed)
    return StepPeak(arguments, outputs, alias, temp, peak, host_bytes=on_host)


def _uncompiled(trainer: Any, batch: Any, temp: int) -> StepPeak:
    """The step XLA refused to compile for the chip: its temporaries as the refusal states them, the
    arguments (model, optimizer, batch) and outputs (model, optimizer) counted from the shapes, the
    outputs written over their donated selves as in a compiled step."""
    from flax import nnx

    state = _per_chip(nnx.state(trainer.model)) + _per_chip(nnx.state(trainer.optimizer))
    arguments = state + _per_chip(batch)
    return StepPeak(arguments, state, state, temp, arguments + temp, compiled=False)


def setup_peak(cfg: LoraSftConfig, trainer: Any, base: Any, chips: int) -> int:
    """The set-up's peak per chip (module doc)."""
    from flax import nnx

    lora_state = nnx.state(trainer.model)
    if cfg.quantization != "none" and chips == 1:  # built in host memory, placed array by array
        largest = max((_per_chip(leaf) for leaf in _leaves(lora_state)), default=0)
        return _per_chip(lora_state) + largest
    new = _per_chip(nnx.state(trainer.model, nnx.LoRAParam))
    if cfg.quantization != "none":  # the quantized kernels are made while the full model is alive
        new = _per_chip(lora_state)
    return _per_chip(nnx.state(base)) + new


def _leaves(tree: Any) -> list[Any]:
    import jax

    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "shape")]


def known_topology(target: rule.Slice) -> None:
    """Refuses a slice MaxText has no chips' description for, naming those of the generation it has."""
    from maxtext.utils import accelerator_to_spec_map as specs

    names = specs.UserFacingNameToSystemCharacteristics
    if target.maxtext_name in names:
        return
    prefix = target.generation.name + ":"
    same = sorted(
        {
            t.removeprefix(prefix)
            for c in names.values()
            if (t := str(getattr(c, "topology_name", ""))).startswith(prefix)
        },
        key=lambda t: [int(d) for d in t.split("x") if d.isdigit()],
    )
    raise LoraflowError(
        f"compute.lora_sft.tpu_topology {target.topology}: MaxText knows no {target.generation.name} slice of "
        f"{target.chips} chips ({target.maxtext_name}); set one of {', '.join(same)}"
    )


def predict(
    cfg: LoraSftConfig, target: rule.Slice, per_device_batch: float, remat_policy: str | None = None
) -> Prediction:
    """The predicted peak per chip of lora_sft's training of ``cfg`` at ``per_device_batch`` on ``target``
    (with ``remat_policy``: under that MaxText remat policy)."""
    from maxtext.trainers.pre_train import train_compile

    known_topology(target)
    with tempfile.TemporaryDirectory(prefix="loraflow-fit-") as work:
        config = maxtext_config(cfg, target.maxtext_name, target.chips, per_device_batch, work, remat_policy)
        return _predicted(cfg, config, train_compile.get_topology_mesh(config), target.chips, per_device_batch)


def predict_here(
    cfg: LoraSftConfig, model_name: str, overrides: dict[str, Any], scan_layers: bool, remat_policy: str
) -> Prediction:
    """The predicted peak per device of lora_sft's training of ``cfg`` on the devices JAX has here, under
    ``remat_policy``: the step compiled for them from shapes, as :func:`predict` compiles it for a slice."""
    import jax
    from maxtext.utils import maxtext_utils

    with tempfile.TemporaryDirectory(prefix="loraflow-tuning-") as work:
        config = present_config(cfg, model_name, overrides, scan_layers, work, remat_policy)
        mesh = maxtext_utils.get_mesh_from_config(config)
        return _predicted(cfg, config, mesh, jax.device_count(), cfg.batch_size / jax.device_count())


def _predicted(cfg: LoraSftConfig, config: Any, mesh: Any, chips: int, per_device_batch: float) -> Prediction:
    import jax
    from flax import nnx

    trainer, base = abstract_trainer(config, mesh)
    step = step_peak(trainer, config, mesh)
    state = _per_chip(nnx.state(trainer.model)) + _per_chip(nnx.state(trainer.optimizer))
    setup = setup_peak(cfg, trainer, base, chips)
    del trainer, base
    jax.clear_caches()
    # The trace and the compile leave their objects in reference cycles (91,000 of them for the tiny model,
    # the compiled program among them), which only a full collection frees. Freed here, at set-up, not at whatever
    # training step the collector next walks the heap: twice on the chip one step of a `tuning: auto` run
    # took 1.5-2.0 s against its neighbours' 0.51 (bench/notes.md section 13; the cause not yet confirmed there).
    gc.collect()
    queued = rule.queued_peak(step.peak_bytes, step.output_bytes, step.alias_bytes, setup)
    return Prediction(per_device_batch, step, state, setup, max(step.peak_bytes, setup), queued)


def sizing(cfg: LoraSftConfig, target: rule.Slice, search: bool = True) -> dict[str, Any]:
    """The prediction at the config's batch and, with ``search``, the largest per-device batch that fits:
    the peak at a second batch, the line through both (:func:`loraflow.spec.fit.largest_batch`), and its
    candidate checked both ways (:func:`loraflow.spec.fit.largest_fitting`: one row more while it fits,
    one row less while it does not, until a batch fits and the one above it does not; at most
    SEARCH_COMPILES compiles after the line's two). ``peaks`` reports every batch compiled.

    With ``training.tuning: auto`` every remat policy tuning may choose (:data:`loraflow.spec.tuning.CANDIDATES`)
    is first predicted at the asked batch, and the one tuning chooses (:func:`loraflow.spec.tuning.choose`,
    else ``full``) is the one sized: ``tuning`` reports the choice and each candidate's peak."""
    hbm = target.generation.hbm_bytes
    asked = cfg.batch_size / target.chips
    policy, chosen = None, None
    if cfg.tuning == "auto":
        candidates = {p: predict(cfg, target, asked, p) for p in tuning_rules.CANDIDATES}
        choice = tuning_rules.decided({p: c.peak_bytes for p, c in candidates.items()}, hbm)
        policy, first = choice.policy, candidates[choice.policy]
        chosen = {"remat_policy": choice.policy, "fits": choice.fits, "peaks": choice.peaks}
    else:
        first = predict(cfg, target, asked)
    peaks = {asked: first.peak_bytes}
    largest = -1
    if search:
        second = asked * 2 if asked >= 1 else 1.0
        peaks[second] = predict(cfg, target, second, policy).peak_bytes
        largest = rule.largest_fitting(
            peaks, hbm, lambda batch: predict(cfg, target, float(batch), policy).peak_bytes, SEARCH_COMPILES
        )
    return {
        "slice": target.maxtext_name,
        "describe": target.describe(),
        "chips": target.chips,
        "hbm_bytes": hbm,
        "hbm_source": target.generation.source,
        "asked": asdict(first),
        "peaks": sorted([b, p] for b, p in peaks.items()),
        "verdict": asdict(rule.verdict(first.peak_bytes, hbm, largest)),
        **({"tuning": chosen} if chosen is not None else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraflow.trainer.fit", description=__doc__.splitlines()[0])
    p.add_argument("--config-json", required=True, help="lora_sft's config (loraflow plan --json shows it)")
    p.add_argument("--machine-type", required=True, help="compute.lora_sft.machine_type, e.g. ct5lp-hightpu-1t")
    p.add_argument("--topology", default=None, help="compute.lora_sft.tpu_topology, e.g. 1x1")
    p.add_argument("--no-search", action="store_true", help="only the asked batch (one compile)")
    args = p.parse_args(argv)
    for key, value in LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    try:
        cfg = parse(LoraSftConfig, json.loads(args.config_json))
        target = rule.slice_of(args.machine_type, args.topology)
        result = sizing(cfg, target, search=not args.no_search)
    except LoraflowError as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
