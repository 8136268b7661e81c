"""``training.tuning: auto``: lora_sft trains with the remat policy that recomputes least and still fits.

MaxText's default remat policy (``full``) keeps nothing of a layer's forward pass for the backward pass
and computes the whole forward again there. Under LoRA the frozen weights take no weight gradients, so
a step is about a forward and a half without remat, and ``full`` adds a whole forward more (up to 1.5x
the step time). A policy that keeps some of the forward's values needs more memory for them and
recomputes less. The results are the same under every policy (the same arithmetic, in a different
order of evaluation); only the step time and the memory differ.

The candidates, in the order they are tried (:data:`CANDIDATES`), are MaxText's own policies
(``maxtext/layers/nnx_decoders.py`` ``get_remat_policy``) ordered by what each keeps of a decoder
layer's projections (``jax.checkpoint_policies.save_only_these_names``), most first; each one keeps a
subset of the one before it, and what is not kept is recomputed:

* ``minimal``: the query, key, value and output projections and the MLP's (``mlpwi_0``, ``mlpwi_1``,
  ``mlpwo``): only the attention itself and the activations are recomputed;
* ``save_dot_except_mlpwi``: the same less the MLP's first two projections (the widest ones);
* ``save_dot_except_mlp``: the attention's projections only (query, key, value, output);
* ``save_qkv_proj``: query, key and value only;
* ``save_out_proj``: the attention's output projection only (one vector per token, less than query,
  key and value together), so the projections before it and the MLP are recomputed;
* ``full``: nothing (MaxText's default), always last: it is what runs when nothing else fits.

The choice (:func:`choose`) is pure: given each candidate's predicted peak bytes per chip (the trainer
predicts them, :mod:`loraflow.trainer.tuning`) and the chip's HBM, the first candidate that
:func:`loraflow.spec.fit.fits` (plan ``--fit``'s verdict, the same rule) with :data:`HEADROOM` of the chip
left free, else ``full``. Each prediction is a compile of the train step, so :func:`tune` stops at the
first candidate that fits: one compile when ``minimal`` fits, all six only when no candidate before ``full``
fits.
Pure and light: every environment imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from loraflow.spec import fit as fit_rule

#: MaxText's remat policies lora_sft may choose, most kept (least recomputed) first; ``full`` last
CANDIDATES = ("minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "full")
#: MaxText's default: what lora_sft trains with when no other candidate is predicted to fit
FALLBACK = "full"
#: the MaxText setting tuning chooses
KEY = "remat_policy"
#: the share of the chip a candidate other than FALLBACK must leave free: the prediction has come out 0.5-2.7 %
#: under what the chip used, less the PEFT export's transient since run on the host (2.2-4.5 % with it:
#: bench/notes.md section 18), and a policy tuning picks must not turn a run that trains under full into an
#: out-of-memory
HEADROOM = 0.05


def _fits(policy: str, peak_bytes: int, hbm_bytes: int) -> bool:
    """Whether ``policy`` at ``peak_bytes`` may be chosen on a chip of ``hbm_bytes``: FALLBACK by plan --fit's
    rule (it is what trains without tuning), every other with :data:`HEADROOM` left free."""
    budget = hbm_bytes if policy == FALLBACK else hbm_bytes - int(hbm_bytes * HEADROOM)
    return fit_rule.fits(peak_bytes, budget)


def conflict(tuning: str, overrides: Mapping[str, Any] | None) -> str | None:
    """Why ``training.tuning`` and ``base_model.model_overrides`` cannot both stand, or None: with auto,
    lora_sft chooses ``remat_policy`` itself, so a spec that sets it too is refused."""
    if tuning != "auto" or not overrides or KEY not in overrides:
        return None
    return (
        f"training.tuning: auto chooses MaxText's {KEY} itself, but base_model.model_overrides.{KEY} sets it "
        f"({overrides[KEY]}); remove base_model.model_overrides.{KEY}, or set training.tuning: off to train "
        "with the policy you name"
    )


def choose(peaks: Mapping[str, int], hbm_bytes: int) -> str | None:
    """The first of :data:`CANDIDATES` (in their order) predicted in ``peaks`` (``{policy: peak bytes per
    chip}``) whose peak fits ``hbm_bytes`` (:func:`_fits`); None when none of them does."""
    for policy in CANDIDATES:
        if policy in peaks and _fits(policy, peaks[policy], hbm_bytes):
            return policy
    return None


@dataclass(frozen=True)
class Choice:
    """What tuning chose, and why."""

    policy: str  # the remat policy lora_sft trains with
    peaks: dict[str, int] = field(default_factory=dict)  # the predicted peak per chip of each candidate tried
    hbm_bytes: int | None = None  # the chip's; None: the devices report no limit (CPU), nothing was compiled
    # (with a limit, :func:`tune`'s ``peaks`` holds the candidates before the chosen one, which did not fit,
    # and the chosen one's: it predicts no further)
    fits: bool = True  # False: no candidate was predicted to fit; FALLBACK kept

    def note(self) -> str:
        """The task log's line: the policy, its predicted peak of the chip's, and the peak of each candidate
        before it that was predicted and did not fit."""
        if self.hbm_bytes is None:
            return (
                f"tuning: {KEY}={self.policy} (the devices report no memory limit, as on a CPU: the first "
                "candidate, nothing compiled)"
            )
        if not self.fits:
            tried = ", ".join(f"{p} {_gib(b)}" for p, b in self.peaks.items())
            return (
                f"tuning: {KEY}={self.policy}, MaxText's default: no candidate is predicted to fit "
                f"{_gib(self.hbm_bytes)} ({tried}); training as without tuning"
            )
        chosen = f"predicted {_gib(self.peaks[self.policy])} of {_gib(self.hbm_bytes)}"
        before = CANDIDATES[: CANDIDATES.index(self.policy)]
        over = ", ".join(f"{p} {_gib(self.peaks[p])}" for p in before if p in self.peaks)
        beside = f"; did not fit: {over}" if over else ""
        return f"tuning: {KEY}={self.policy} ({chosen}{beside})"

    def summary(self) -> dict[str, Any]:
        """The step summary's figures: the policy, each candidate's predicted peak, the chip's HBM."""
        return {
            "tuning_remat_policy": self.policy,
            "tuning_fits": self.fits,
            "tuning_hbm_bytes": self.hbm_bytes,
            "tuning_peak_bytes": dict(self.peaks),
        }


def tune(peak_of: Callable[[str], int], hbm_bytes: int | None) -> Choice:
    """Predict the candidates in order (``peak_of(policy)``: peak bytes per chip, one compile each) until one
    fits ``hbm_bytes``, and none after it: the first that fits is the choice whatever the later ones would
    need. With no limit (``hbm_bytes`` None) the first candidate, nothing predicted. None fitting: ``full``
    (MaxText's default, predicted as the last candidate) and ``fits`` False; a run that would train without
    tuning trains."""
    if hbm_bytes is None:
        return Choice(CANDIDATES[0])
    peaks: dict[str, int] = {}
    for policy in CANDIDATES:
        peaks[policy] = peak_of(policy)
        if choose(peaks, hbm_bytes):
            break
    return decided(peaks, hbm_bytes)


def decided(peaks: Mapping[str, int], hbm_bytes: int) -> Choice:
    """The choice among the candidates predicted in ``peaks`` on a chip of ``hbm_bytes`` (:func:`choose`), or
    FALLBACK with ``fits`` False when none fits; what :func:`tune` and ``plan --fit`` both report."""
    chosen = choose(peaks, hbm_bytes)
    return Choice(chosen or FALLBACK, dict(peaks), hbm_bytes, fits=chosen is not None)


def _gib(n: int) -> str:
    return f"{n / fit_rule.GIB:.1f} GiB"
