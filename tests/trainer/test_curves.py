"""The curves' scalars (loraflow/trainer/curves.py, loraflow/reporting/curves.py) written with tensorboardX
and read back with TensorBoard's own reader; fast (no training: tests/trainer/test_trainer_steps.py checks a
training run's curves against its loss.csv, tests/serving/test_evaluate.py an evaluation's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loraflow.reporting.curves import evaluation_scalars, tensorboard_argv, tensorboard_command, trained_steps
from loraflow.storage.artifacts import Manifest
from loraflow.trainer.curves import GIB, learning_rates, rate_at, training_curves
from loraflow.trainer.step_log import StepRow
from tests.tensorboard_events import scalars


def test_the_curves_carry_device_memory_where_the_backend_reports_it(tmp_path: Path) -> None:
    """A TPU reports bytes in use and their peak (CPU reports none: the training run's curves have no memory
    tags); only the process that commits the artifact writes curves."""
    with training_curves(tmp_path / "p1", writes=False) as none:
        assert none is None
    with training_curves(tmp_path / "p0", writes=True) as curves:
        assert curves is not None
        curves.step(
            StepRow(1, 2.5, 1000.0, 0.25, 250), 1e-3, lambda: {"bytes_in_use": 3 * GIB, "peak_bytes_in_use": 5 * GIB}
        )
        curves.step(StepRow(100, 2.0, 900.0, 0.5, 450), 2e-3, lambda: {"bytes_in_use": GIB})  # no peak: in use
        curves.step(StepRow(200, 1.5, 800.0, 0.75, 600), 3e-3, lambda: {"bytes_limit": 16 * GIB})  # none in use
    assert not (tmp_path / "p1").exists()
    assert scalars(tmp_path / "p0" / "tensorboard") == {
        "train/loss": {1: 2.5, 100: 2.0, 200: 1.5},
        "train/learning_rate": {1: pytest.approx(1e-3), 100: pytest.approx(2e-3), 200: pytest.approx(3e-3)},
        "perf/step_seconds": {1: 0.25, 100: 0.5, 200: 0.75},
        "perf/tokens_per_s": {1: 1000.0, 100: 900.0, 200: 800.0},
        "memory/hbm_in_use_gib": {1: 3.0, 100: 1.0},
        "memory/hbm_peak_gib": {1: 5.0, 100: 1.0},
    }


def test_the_device_memory_is_read_after_step_1_and_every_100th_only(tmp_path: Path) -> None:
    """On a TPU a memory read waits for the steps queued on the chip: read every step, it kept the host from
    running ahead (issue 39). 250 steps read it 3 times, and only those steps carry memory tags."""
    reads: list[int] = []

    def memory() -> dict[str, int]:
        reads.append(len(rows))
        return {"bytes_in_use": GIB}

    rows: list[int] = []
    with training_curves(tmp_path, writes=True) as curves:
        assert curves is not None
        for step in range(1, 251):
            rows.append(step)
            curves.step(StepRow(step, 1.0, 100.0, 0.5, 50), 1e-3, memory)
    assert reads == [1, 100, 200]
    tags = scalars(tmp_path / "tensorboard")
    assert sorted(tags["memory/hbm_in_use_gib"]) == [1, 100, 200]
    assert len(tags["train/loss"]) == 250


def test_the_learning_rates_are_the_schedules_computed_once_and_step_n_gets_update_n_minus_1() -> None:
    """The curves' rates come from one evaluation of the schedule before training (at a step's end the
    schedule's computation waits for the step queued on the chip: issue 39); step N (from 1) updated with
    the rate of update N - 1, and a step past the schedule's end with its last rate."""
    import jax.numpy as jnp
    import optax

    calls: list[object] = []

    def schedule(count):
        calls.append(count)
        return optax.linear_schedule(0.0, 1.0, 4)(count) + jnp.where(count >= 3, 10.0, 0.0)

    rates = learning_rates(schedule, 5)
    assert rates == (0.0, 0.25, 0.5, 10.75, 11.0) and len(calls) == 1  # one traced call, not one per step
    assert [rate_at(rates, step) for step in (1, 2, 4, 5, 6, 99)] == [0.0, 0.25, 10.75, 11.0, 11.0, 11.0]


def test_an_evaluation_scores_at_its_models_training_step() -> None:
    """The base model (no manifest) at step 0; a merged model at its adapter's steps; the guard's accuracy
    beside the metrics."""
    merged = Manifest("gs://b/p/r/merge_adapter/_MANIFEST.json", {"summary": {"adapter_steps": 150}})
    unknown = Manifest("gs://b/p/r/merge_adapter/_MANIFEST.json", {"summary": {}})
    assert [trained_steps(m) for m in (None, merged, unknown)] == [0, 150, 0]
    assert evaluation_scalars({"accuracy": 0.75, "format_rate": 1}, None) == {
        "eval/accuracy": 0.75,
        "eval/format_rate": 1.0,
    }
    assert evaluation_scalars({"accuracy": 0.5}, {"set": "general-mc-v1", "accuracy": 0.25}) == {
        "eval/accuracy": 0.5,
        "guard/accuracy": 0.25,
    }
    gsm8k = {"task": "gsm8k", "metric": "exact_match,strict-match", "value": 0.375, "ids": ["0"], "values": [1.0]}
    assert evaluation_scalars({"accuracy": 0.5}, None, {"gsm8k": gsm8k}) == {
        "eval/accuracy": 0.5,
        "suite/gsm8k": 0.375,
    }


def test_the_tensorboard_command_reads_gcs_or_the_emulator_and_binds_loopback() -> None:
    """What `make ui` prints: against GCS, TensorBoard as it is; against the emulator, its address and the
    Python loader (the Rust one asks Google for a token and fails)."""
    assert tensorboard_command("tb", "gs://b/pipe") == "tb --host 127.0.0.1 --logdir gs://b/pipe"
    env, argv = tensorboard_argv("/v/bin/tensorboard", "gs://b/pipe", "http://127.0.0.1:4443")
    assert env == {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    assert argv == ["/v/bin/tensorboard", "--host", "127.0.0.1", "--logdir", "gs://b/pipe", "--load_fast", "false"]
    assert tensorboard_command("/v/bin/tensorboard", "gs://b/my pipe", "http://127.0.0.1:4443") == (
        "STORAGE_EMULATOR_HOST=http://127.0.0.1:4443 GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false /v/bin/tensorboard "
        "--host 127.0.0.1 --logdir 'gs://b/my pipe' --load_fast false"
    )
