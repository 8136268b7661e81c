"""Will it fit? The TPU slice a spec's ``lora_sft`` runs on, and the arithmetic of fitting its training in
one chip's memory.

Pure and light (every environment imports it): the prediction itself, XLA's memory analysis of the train
step compiled from shapes for the slice's topology, is :mod:`loraflow.trainer.fit` in the trainer
environment; ``loraflow plan SPEC --fit`` joins the two (docs/production.md, "Will it fit?").
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError

GIB = 2**30


@dataclass(frozen=True)
class Generation:
    """One TPU generation as a machine type names it (``ct5lp-...``) and as JAX and MaxText name it."""

    name: str  # JAX's topology prefix and MaxText's compile_topology prefix: v5e
    hbm_bytes: int  # what one chip's programs may use
    cores_per_chip: int  # MaxText names v4 and v5p slices by TensorCores, the others by chips
    source: str  # where hbm_bytes comes from


# v5e: the chip's own bytes_limit, read on one v5e chip (bench/results/tpu-1b.json), 15.75 of its 16 GiB.
# The others: the generation's HBM less the same share (1.6 %), not measured here.
_V5E_LIMIT = 16_909_336_064
_SHARE = _V5E_LIMIT / (16 * GIB)
GENERATIONS: dict[str, Generation] = {
    "ct5lp": Generation("v5e", _V5E_LIMIT, 1, "measured on a v5e chip: its bytes_limit"),
    "ct6e": Generation("v6e", int(32 * GIB * _SHARE), 1, "32 GiB less v5e's reserve (not measured)"),
    "ct5p": Generation("v5p", int(95 * GIB * _SHARE), 2, "95 GiB less v5e's reserve (not measured)"),
    "ct4p": Generation("v4", int(32 * GIB * _SHARE), 2, "32 GiB less v5e's reserve (not measured)"),
}
# Single-host shapes by chips per host, for a spec that names the machine and no tpu_topology.
_HOST_TOPOLOGY = {1: "1x1", 4: "2x2", 8: "2x4"}


@dataclass(frozen=True)
class Slice:
    """The TPU slice ``compute.lora_sft`` names."""

    generation: Generation
    topology: str  # e.g. 2x2
    chips: int
    machine_type: str  # e.g. ct5lp-hightpu-4t

    @property
    def maxtext_name(self) -> str:
        """MaxText's ``compile_topology`` (maxtext/utils/accelerator_to_spec_map.py): v5e-4, v5p-8."""
        return f"{self.generation.name}-{self.chips * self.generation.cores_per_chip}"

    def describe(self) -> str:
        return f"TPU {self.generation.name} {self.topology} ({self.chips} chip{'s' if self.chips != 1 else ''})"


def lora_sft_slice(compute: Any) -> Slice:
    """The slice of a spec's ``compute.lora_sft`` entry (:meth:`PipelineSpec.compute_for`); refuses, naming
    the fix, an entry that is no TPU machine, a TPU family loraflow has no figures for, or a bad topology."""
    machine = getattr(compute, "machine_type", None)
    if not machine or not str(machine).startswith("ct"):
        where = f"machine_type {machine}" if machine else f"launcher {compute.launcher}"
        raise LoraflowError(
            f"compute.lora_sft runs on no TPU ({where}): --fit predicts a TPU chip's memory. Name the slice in "
            "compute.lora_sft (launcher vertex or gke, machine_type e.g. ct5lp-hightpu-1t, tpu_topology e.g. 1x1)"
        )
    return slice_of(str(machine), compute.tpu_topology)


def slice_of(machine: str, topology: str | None) -> Slice:
    """The slice of TPU machine type ``machine`` (``ct5lp-hightpu-4t``) in ``topology`` (None: the one
    host's own shape); refuses a family loraflow has no figures for and a topology not like 2x2."""
    family = machine.split("-")[0]
    if family not in GENERATIONS:
        raise LoraflowError(
            f"compute.lora_sft.machine_type {machine}: no TPU generation loraflow knows "
            f"(known: {', '.join(f'{k}-* ({g.name})' for k, g in GENERATIONS.items())}); use one of those"
        )
    if topology is None:
        per_host = re.search(r"-(\d+)t$", str(machine))
        topology = _HOST_TOPOLOGY.get(int(per_host.group(1))) if per_host else None
        if topology is None:
            raise LoraflowError(f"compute.lora_sft.tpu_topology is not set for {machine}; set it (e.g. 2x2)")
    dims = str(topology).split("x")
    if not all(d.isdigit() and int(d) > 0 for d in dims) or len(dims) not in (2, 3):
        raise LoraflowError(f"compute.lora_sft.tpu_topology {topology!r} is not like 2x2 or 2x2x1; correct it")
    return Slice(GENERATIONS[family], str(topology), math.prod(int(d) for d in dims), machine)


@dataclass(frozen=True)
class Verdict:
    """Whether the asked batch fits, by how much, and the largest per-device batch that does."""

    fits: bool
    margin_bytes: int  # HBM left at the peak; negative: short by that much
    largest_batch: int  # per device; 0: not even one row fits


def queued_peak(step_peak: int, output_bytes: int, alias_bytes: int, setup_bytes: int) -> int:
    """The chip's peak while Tunix keeps a second train step queued (``max_inflight_computations``, 2): the
    queued step's outputs are one more copy of what the step writes to new buffers (its outputs less those
    over donated arguments). The chip holds it only where the host runs ahead and there is room (where there
    is not, the step waits), so it says what the chip may hold above the one-step peak, never whether it
    fits. Never below the set-up's peak."""
    return max(setup_bytes, step_peak + output_bytes - alias_bytes)


def fits(peak_bytes: int, hbm_bytes: int) -> bool:
    return peak_bytes <= hbm_bytes


def largest_batch(peaks: Sequence[tuple[float, int]], hbm_bytes: int) -> int:
    """The largest whole per-device batch whose peak stays within ``hbm_bytes``, from the peaks predicted at
    two or more batches (``(per-device batch, peak bytes)``): the peak grows linearly with the batch (the
    state does not grow, the activations and their gradients do), so the line through the smallest and
    the largest batch predicted says where it crosses the chip's memory. 0 when even one row is too many."""
    if len(peaks) < 2:
        raise ValueError("largest_batch needs the peak at two batches at least")
    (b1, p1), (b2, p2) = min(peaks), max(peaks)
    if b2 <= b1:
        raise ValueError(f"largest_batch needs two different batches, got {sorted({b for b, _ in peaks})}")
    per_row = (p2 - p1) / (b2 - b1)
    if per_row <= 0:  # the batch costs nothing more: only the state decides
        return 0 if p1 > hbm_bytes else int(b2)
    fixed = p1 - per_row * b1
    return max(0, math.floor((hbm_bytes - fixed) / per_row))


def largest_fitting(peaks: dict[float, int], hbm_bytes: int, peak_at: Callable[[int], int], max_compiles: int) -> int:
    """The largest whole per-device batch whose peak stays within ``hbm_bytes``, checked both ways: from
    the line's candidate (:func:`largest_batch` over ``peaks``, ``{per-device batch: peak bytes}`` at two
    batches or more; at least 1), one row more while it fits and one row less while it does not, until a
    batch fits and the one above it is known not to. ``peak_at`` predicts the peak at a batch not yet in
    ``peaks`` (a compile), and each prediction is recorded in ``peaks``; at most ``max_compiles`` of them.
    The peak is not exactly linear in the batch (the tiny model's, since the step donates the model, is
    not), so the line's candidate may be rows short of the largest that fits, or rows over it. Returns the largest whole batch
    known to fit (0 when none is): with the compiles spent before the search ended, it may be short."""
    batch = max(1, largest_batch(list(peaks.items()), hbm_bytes))
    compiles = 0
    while True:
        if batch not in peaks:
            if compiles >= max_compiles:
                break
            peaks[float(batch)] = peak_at(batch)
            compiles += 1
        if fits(peaks[batch], hbm_bytes):
            batch += 1  # the search stops only on a batch that does not fit (or with the compiles spent)
        elif batch == 1 or (batch - 1 in peaks and fits(peaks[batch - 1], hbm_bytes)):
            break  # the row below it fits (or there is none): the largest that fits is known
        else:
            batch -= 1
    whole = [int(b) for b, p in peaks.items() if float(b).is_integer() and fits(p, hbm_bytes)]
    return max(whole, default=0)


def verdict(peak_bytes: int, hbm_bytes: int, largest: int) -> Verdict:
    return Verdict(fits(peak_bytes, hbm_bytes), hbm_bytes - peak_bytes, largest)
