"""training.tuning: auto in lora_sft (loraflow/trainer/tuning.py): the remat policy chosen reaches MaxText's
config, the training it gives is tuning off's, and where no candidate fits the run trains as without tuning."""

from __future__ import annotations

import csv
import gc
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).parent))

import pytest

pytest.importorskip("maxtext")

import orbax.checkpoint as ocp
from jax._src import monitoring  # its listeners: jax.monitoring registers them, says none
from tensorboardX import event_file_writer
from test_trainer_steps import SFT, _ctx

from loraflow.errors import LoraflowError
from loraflow.spec import tuning as tuning_rules
from loraflow.spec.step_configs import LoraSftConfig, parse
from loraflow.trainer import tuning
from loraflow.trainer.converted import read_converted
from loraflow.trainer.sft_run import SftRun

STEPS = 12
# Objects in reference cycles a prediction may leave behind. Unless it collects them itself
# (loraflow.trainer.fit._predicted), the tiny model's leaves about 91,000 (the trace and the compiled
# program), 35,600 of them in the old generation that only a full collection walks; it leaves 0.
LEFT_FOR_TRAINING = 5_000


def _recorded(init: Callable[..., None], made: list[str], name: str) -> Callable[..., None]:
    """``init``, recording ``name`` and the folder it was made for (its first argument) in ``made``."""

    def recording(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(f"{name} {args[0] if args else kwargs}")
        init(self, *args, **kwargs)

    return recording


def _train(base: dict[str, Any], name: str, config: dict[str, Any], mp: pytest.MonkeyPatch) -> dict[str, Any]:
    """lora_sft on the tiny model: its summary, loss rows, task log and the remat policy of MaxText's config."""
    from maxtext.configs import pyconfig

    from loraflow.steps import lora_sft

    policies: list[str] = []
    initialize = pyconfig.initialize_pydantic

    def recording(argv: list[str], **kwargs: Any) -> Any:
        made = initialize(argv, **kwargs)
        if argv[0] == "lora_sft":  # the stage's own config, not a prediction's
            policies.append(made.remat_policy)
        return made

    mp.setattr(pyconfig, "initialize_pydantic", recording)
    root = base["root"] / f"tuning-{name}"
    inputs = {"checkpoint": base["ckpt"], "dataset": base["dataset"], "tokenizer": base["hf"]}
    ctx = _ctx(root, "lora_sft", inputs, config, str(root / "remote" / "lora_sft"))
    lines: list[str] = []
    ctx.progress = lines.append  # type: ignore[method-assign]
    summary = lora_sft.run(ctx)
    rows = list(csv.DictReader((ctx.out / "loss.csv").open()))
    return {"summary": summary, "loss": [float(r["loss"]) for r in rows], "progress": lines, "policies": policies}


@pytest.fixture(scope="module")
def off_and_auto(base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    config = {**SFT, "steps": STEPS, "checkpoint_period": STEPS}
    with pytest.MonkeyPatch.context() as mp:
        off = _train(base, "off", config, mp)
    with pytest.MonkeyPatch.context() as mp:
        auto = _train(base, "auto", {**config, "tuning": "auto"}, mp)
    return {"off": off, "auto": auto}


def test_auto_on_cpu_trains_with_the_first_candidate_in_maxtexts_config(off_and_auto) -> None:
    off, auto = off_and_auto["off"], off_and_auto["auto"]
    assert off["policies"] == ["full"] and "tuning_remat_policy" not in off["summary"]
    assert not any(line.startswith("tuning:") for line in off["progress"])
    assert auto["policies"] == ["minimal"] == [tuning_rules.CANDIDATES[0]]
    said = [line for line in auto["progress"] if line.startswith("tuning:")]
    assert said == [
        "tuning: remat_policy=minimal (the devices report no memory limit, as on a CPU: the first candidate, "
        "nothing compiled)"
    ]
    s = auto["summary"]
    assert (s["tuning_remat_policy"], s["tuning_fits"], s["tuning_hbm_bytes"], s["tuning_peak_bytes"]) == (
        "minimal",
        True,
        None,
        {},
    )


def test_auto_learns_as_off_does(off_and_auto) -> None:
    """Remat changes what the backward pass recomputes, not the arithmetic: the float32 losses agree
    step by step within float32's reordering error. Each loss is a mean over the batch's tokens of
    log-softmax terms; XLA may fuse a recomputed forward differently, so a sum of n terms may be added
    in another order: at most (n - 1) * 2**-24 of the sum of their magnitudes, n the tokens of a batch
    (8 x 64 = 512): 3.0e-5 of the loss. Twelve Adam steps carry such differences forward; ten times that,
    3.0e-4 of the loss, still catches a wrong gradient, which moves these losses (6.06 -> 4.13) by 1e-2 or
    more within a few steps at this learning rate. (Measured on this CPU: the same to loss.csv's last
    digit, 1e-6, at every step.)"""
    off, auto = off_and_auto["off"]["loss"], off_and_auto["auto"]["loss"]
    assert len(off) == len(auto) == STEPS
    tokens = SFT["batch_size"] * SFT["max_length"]
    one_step = (tokens - 1) * 2.0**-24
    for step, (a, b) in enumerate(zip(off, auto, strict=True), start=1):
        assert a == pytest.approx(b, rel=10 * one_step), (step, a, b)
    assert off[-1] < off[0]  # it trained


def test_no_candidate_fits_keeps_full_and_says_so(base: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every candidate's step compiled for the devices here (the tiny model's, on the CPU) against a
    device of 1 byte: none fits, so full, MaxText's default: the run trains as it would without tuning."""
    monkeypatch.setattr(tuning, "device_memory_limit", lambda: 1)
    cfg = parse(LoraSftConfig, {**SFT, "tuning": "auto"})
    lines: list[str] = []
    sft = SftRun(cfg, read_converted(cfg, base["ckpt"]), base["dataset"], base["hf"], "", base["root"], lines.append)
    choice = tuning.choose_remat(sft)
    assert choice is not None and choice.policy == "full" and not choice.fits
    assert list(choice.peaks) == list(tuning_rules.CANDIDATES)
    assert all(peak > 1 for peak in choice.peaks.values())
    assert len(lines) == 1 and lines[0].startswith("tuning: remat_policy=full, MaxText's default: no candidate")
    assert "6 compiles in" in lines[0]


def test_a_first_candidate_that_fits_is_the_only_compile(base: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A device of 1 TiB: minimal, the first candidate, fits, and it is the only step compiled (no full
    beside it: each compile is set-up time on a chip); the task log says so. The prediction frees what
    its compile left in reference cycles before training starts, not in some training step."""
    from maxtext.trainers.post_train.sft import train_sft  # noqa: F401 (imported, it starts a thread of its own)

    from loraflow.trainer import fit

    monkeypatch.setattr(tuning, "device_memory_limit", lambda: 1 << 40)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    compiled: list[str] = []
    predict_here = fit.predict_here

    def counting(*args: Any) -> Any:
        compiled.append(args[-1])
        return predict_here(*args)

    monkeypatch.setattr(fit, "predict_here", counting)
    cfg = parse(LoraSftConfig, {**SFT, "tuning": "auto"})
    lines: list[str] = []
    sft = SftRun(cfg, read_converted(cfg, base["ckpt"]), base["dataset"], base["hf"], "", base["root"], lines.append)
    # young collections as usual, no full one: a full collection after it finds what the prediction left
    # in the old generation for the collector to free at some training step
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(thresholds[0], thresholds[1], 1 << 30)
    # event file writers and checkpoint managers made while choosing (a finished stage's trainer of an
    # earlier test may remake its own writer when JAX records a scalar: only the prediction's count)
    made: list[str] = []
    for owner in (event_file_writer.EventFileWriter, ocp.CheckpointManager):
        monkeypatch.setattr(owner, "__init__", _recorded(owner.__init__, made, owner.__name__))
    listeners = monitoring.get_scalar_listeners()
    try:
        choice = tuning.choose_remat(sft)
        left = gc.collect()
    finally:
        gc.set_threshold(*thresholds)
    assert left < LEFT_FOR_TRAINING, left
    # nothing of the prediction's trainer lives on beside the training: no TensorBoard writer (with its two
    # threads) listening for every scalar the process records, the stage's own trainer's included, and no
    # checkpoint manager over the folder the prediction deletes
    assert [m for m in made if "loraflow-tuning-" in m] == [], made
    assert monitoring.get_scalar_listeners() == listeners
    assert "XLA_FLAGS" not in os.environ  # the prediction's MaxText config turned on no HLO dumps
    assert compiled == ["minimal"]
    assert choice is not None and choice.policy == "minimal" and choice.fits and list(choice.peaks) == ["minimal"]
    assert len(lines) == 1
    assert re.fullmatch(
        r"tuning: remat_policy=minimal \(predicted 0\.0 GiB of 1024\.0 GiB\); 1 compile in \d+s", lines[0]
    )


def test_off_chooses_nothing(base: dict[str, Any]) -> None:
    cfg = parse(LoraSftConfig, SFT)
    sft = SftRun(cfg, read_converted(cfg, base["ckpt"]), base["dataset"], base["hf"], "", base["root"], print)
    assert tuning.choose_remat(sft) is None


def test_the_stage_refuses_auto_beside_a_remat_policy_it_was_sent(base: dict[str, Any], tmp_path: Path) -> None:
    from loraflow.steps import lora_sft

    config = {**SFT, "tuning": "auto", "model_overrides": {**SFT["model_overrides"], "remat_policy": "full"}}
    inputs = {"checkpoint": base["ckpt"], "dataset": base["dataset"], "tokenizer": base["hf"]}
    ctx = _ctx(tmp_path, "lora_sft", inputs, config, str(tmp_path / "remote"))
    with pytest.raises(LoraflowError, match=r"remove base_model\.model_overrides\.remat_policy"):
        lora_sft.sft_run(ctx)
