"""`loraflow plan --fit`: the slice a spec's lora_sft runs on, the arithmetic of fitting, what the command
prints and refuses. The prediction itself (the step compiled for the TPU) is tests/trainer/test_fit.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loraflow.cli import commands, main
from loraflow.errors import LoraflowError
from loraflow.spec import fit
from loraflow.spec.compute import compute_from

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
GIB = 2**30
TPU = "  lora_sft:\n    launcher: vertex\n    image: us-docker.pkg.dev/acme-ml/loraflow/trainer:0.1.0\n"


def _spec(tmp_path: Path, lora_sft: str) -> Path:
    """tiny-llama-qlora with ``lora_sft`` (YAML lines under compute) as its compute entry."""
    text = (PIPELINES / "tiny-llama-qlora.yaml").read_text()
    text = text.replace(
        "compute:\n  default:\n    launcher: local\n", "compute:\n  default:\n    launcher: local\n" + lora_sft
    )
    path = tmp_path / "tiny-llama-qlora.yaml"
    path.write_text(text)
    return path


def test_the_slice_is_read_from_the_machine_and_topology() -> None:
    four = fit.lora_sft_slice(
        compute_from(launcher="vertex", image="i:1", machine_type="ct5lp-hightpu-4t", tpu_topology="4x4")
    )
    assert (four.generation.name, four.chips, four.maxtext_name) == ("v5e", 16, "v5e-16")
    assert four.generation.hbm_bytes == 16_909_336_064  # the v5e chip's own limit, measured
    # v4 and v5p slices are named by TensorCores (two a chip), the others by chips
    assert fit.slice_of("ct5p-hightpu-4t", "2x2x1").maxtext_name == "v5p-8"
    assert fit.slice_of("ct6e-standard-4t", "2x2").maxtext_name == "v6e-4"
    # one host and no topology: the host's own shape
    assert fit.slice_of("ct5lp-hightpu-1t", None).topology == "1x1"
    assert fit.slice_of("ct5lp-hightpu-8t", None).chips == 8
    assert fit.slice_of("ct6e-standard-4t", None).describe() == "TPU v6e 2x2 (4 chips)"
    assert fit.slice_of("ct5lp-hightpu-1t", "1x1").describe() == "TPU v5e 1x1 (1 chip)"


def test_a_compute_entry_that_is_no_tpu_is_refused_saying_what_it_is() -> None:
    from loraflow.spec.compute import LocalCompute

    with pytest.raises(LoraflowError) as err:
        fit.lora_sft_slice(LocalCompute())
    assert str(err.value).startswith("compute.lora_sft runs on no TPU (launcher local): --fit predicts")
    assert str(err.value).endswith(
        "(launcher vertex or gke, machine_type e.g. ct5lp-hightpu-1t, tpu_topology e.g. 1x1)"
    )
    with pytest.raises(LoraflowError, match=r"runs on no TPU \(machine_type n2-highmem-32\)"):
        fit.lora_sft_slice(compute_from(launcher="vertex", image="i:1", machine_type="n2-highmem-32"))
    # a TPU entry without a topology: the host's own shape
    one_host = fit.lora_sft_slice(compute_from(launcher="gke", image="i:1", machine_type="ct5lp-hightpu-4t"))
    assert (one_host.topology, one_host.chips, one_host.machine_type) == ("2x2", 4, "ct5lp-hightpu-4t")


@pytest.mark.parametrize(
    ("machine", "topology", "says"),
    [
        ("ct9x-hightpu-4t", "2x2", "no TPU generation loraflow knows (known: ct5lp-* (v5e), ct6e-* (v6e), ct5p-*"),
        ("ct5lp-hightpu", None, "tpu_topology is not set for ct5lp-hightpu; set it"),
        ("ct5lp-hightpu-2t", None, "tpu_topology is not set for ct5lp-hightpu-2t; set it"),
        ("ct5lp-hightpu-4t", "2x0", "'2x0' is not like 2x2 or 2x2x1"),
        ("ct5lp-hightpu-4t", "4", "'4' is not like 2x2 or 2x2x1"),
        ("ct5lp-hightpu-4t", "2x2x2x2", "is not like 2x2"),
    ],
)
def test_a_slice_loraflow_cannot_size_is_refused_naming_the_fix(machine: str, topology: str | None, says: str) -> None:
    with pytest.raises(LoraflowError, match=r"compute\.lora_sft") as err:
        fit.slice_of(machine, topology)
    assert says in str(err.value)


def test_largest_batch_is_where_the_line_through_two_peaks_crosses_the_chip() -> None:
    # 2 GiB of state, 1 GiB a row: 16 GiB holds 14 rows, not 15
    peaks = [(1.0, 3 * GIB), (2.0, 4 * GIB)]
    assert fit.largest_batch(peaks, 16 * GIB) == 14
    assert fit.largest_batch(peaks, 16 * GIB - 1) == 13
    assert fit.largest_batch([(8.0, 10 * GIB), (2.0, 4 * GIB), (4.0, 6 * GIB)], 16 * GIB) == 14  # the extremes
    assert fit.largest_batch(peaks, 2 * GIB) == 0  # the state alone fills the chip
    assert fit.largest_batch(peaks, 3 * GIB) == 1
    # the batch costing nothing more: the state decides
    assert fit.largest_batch([(1.0, 5 * GIB), (2.0, 5 * GIB)], 16 * GIB) == 2
    assert fit.largest_batch([(1.0, 17 * GIB), (2.0, 17 * GIB)], 16 * GIB) == 0
    # a byte or less a row still grows: the line, not the state alone, decides
    assert fit.largest_batch([(1.0, 100), (3.0, 101)], 1000) == 1801
    assert fit.largest_batch([(1.0, 5 * GIB), (2.0, 5 * GIB)], 5 * GIB) == 2  # exactly full fits
    with pytest.raises(ValueError, match=r"^largest_batch needs the peak at two batches at least$"):
        fit.largest_batch([(1.0, GIB)], 16 * GIB)
    with pytest.raises(ValueError, match=r"^largest_batch needs two different batches, got \[1\.0\]$"):
        fit.largest_batch([(1.0, GIB), (1.0, GIB)], 16 * GIB)


class _Compiler:
    """A synthetic peak curve standing in for the step's compiles: each batch asked for is recorded."""

    def __init__(self, peak: Callable[[int], int]) -> None:
        self.peak = peak
        self.compiled: list[int] = []

    def __call__(self, batch: int) -> int:
        self.compiled.append(batch)
        return self.peak(batch)


def _linear(batch: int) -> int:  # 2 GiB of state, 1 GiB a row
    return 2 * GIB + batch * GIB


def _bent(per_row_above_4: int) -> Callable[[int], int]:
    """1 GiB a row up to batch 4 (the line through 2 and 4 rows), ``per_row_above_4`` bytes a row above."""
    return lambda batch: _linear(batch) if batch <= 4 else _linear(4) + (batch - 4) * per_row_above_4


def _known(curve: Callable[[int], int], *batches: float) -> dict[float, int]:
    return {b: curve(int(b)) for b in batches}


def test_the_largest_batch_that_fits_is_confirmed_by_one_row_more_that_does_not() -> None:
    chip = _Compiler(_linear)
    peaks = _known(_linear, 1.0, 2.0)
    assert fit.largest_fitting(peaks, 16 * GIB, chip, 4) == 14  # 16 GiB exactly at 14 rows: fits
    assert chip.compiled == [14, 15]  # the line's candidate, then the row above it
    assert peaks == {1.0: 3 * GIB, 2.0: 4 * GIB, 14.0: 16 * GIB, 15.0: 17 * GIB}  # every compile reported


def test_a_line_that_undershoots_is_climbed_until_a_row_more_does_not_fit() -> None:
    # 2/3 GiB a row above 4 rows: the line says 8 rows fit in 10 GiB, 10 do
    curve = _bent(2 * GIB // 3)
    chip = _Compiler(curve)
    peaks = _known(curve, 2.0, 4.0)
    assert fit.largest_batch(list(peaks.items()), 10 * GIB) == 8
    assert fit.largest_fitting(peaks, 10 * GIB, chip, 6) == 10
    assert chip.compiled == [8, 9, 10, 11]  # stops at the first row over, budget left
    assert peaks[10.0] <= 10 * GIB < peaks[11.0]


def test_a_line_that_overshoots_is_descended_until_a_row_fits() -> None:
    # 2 GiB a row above 4 rows: the line says 8 rows fit in 10 GiB, 6 do
    curve = _bent(2 * GIB)
    chip = _Compiler(curve)
    peaks = _known(curve, 2.0, 4.0)
    assert fit.largest_fitting(peaks, 10 * GIB, chip, 6) == 6
    assert chip.compiled == [8, 7, 6]  # 7 already known not to fit: no row above 6 compiled again


def test_when_no_batch_fits_the_answer_is_0() -> None:
    # the state alone over the chip: one row is known not to fit, nothing compiled
    over = _Compiler(lambda batch: 20 * GIB + batch * GIB)
    assert fit.largest_fitting({1.0: 21 * GIB, 2.0: 22 * GIB}, 16 * GIB, over, 4) == 0
    assert over.compiled == []
    # the asked 4 and 8 rows over: one row is compiled before 0 is said
    chip = _Compiler(lambda batch: 20 * GIB + batch * GIB)
    assert fit.largest_fitting({4.0: 24 * GIB, 8.0: 28 * GIB}, 16 * GIB, chip, 4) == 0
    assert chip.compiled == [1]
    # half a row fits, no whole one: 0 (batch_size 1 on two chips)
    assert fit.largest_fitting({0.5: 15 * GIB, 1.0: 17 * GIB}, 16 * GIB, _Compiler(_linear), 4) == 0


def test_a_line_that_says_0_is_checked_at_one_row() -> None:
    # 2 and 4 rows over 16 GiB, the line crossing it at 0 rows; one row fits
    chip = _Compiler(lambda batch: 15 * GIB)
    assert fit.largest_batch([(2.0, 17 * GIB), (4.0, 18 * GIB)], 16 * GIB) == 0
    assert fit.largest_fitting({2.0: 17 * GIB, 4.0: 18 * GIB}, 16 * GIB, chip, 4) == 1
    assert chip.compiled == [1]


def test_the_compile_budget_is_never_exceeded_and_the_largest_known_to_fit_is_said() -> None:
    climbing = _bent(2 * GIB // 3)  # 10 rows fit in 10 GiB, the line says 8
    for budget, compiled, largest in [(0, [], 4), (1, [8], 8), (2, [8, 9], 9), (3, [8, 9, 10], 10)]:
        chip = _Compiler(climbing)
        assert fit.largest_fitting(_known(climbing, 2.0, 4.0), 10 * GIB, chip, budget) == largest
        assert chip.compiled == compiled
    descending = _bent(3 * GIB)  # 5 rows fit in 10 GiB, the line says 8
    for budget, compiled, largest in [(1, [8], 4), (2, [8, 7], 4), (3, [8, 7, 6], 4), (4, [8, 7, 6, 5], 5)]:
        chip = _Compiler(descending)
        assert fit.largest_fitting(_known(descending, 2.0, 4.0), 10 * GIB, chip, budget) == largest
        assert chip.compiled == compiled
    # a curve that never stops fitting: the budget ends the climb
    flat = _Compiler(lambda batch: 5 * GIB)
    assert fit.largest_fitting({1.0: 5 * GIB, 2.0: 5 * GIB}, 16 * GIB, flat, 3) == 5
    assert flat.compiled == [3, 4, 5]
    # only whole batches count as known to fit: 1.5 rows fitting says nothing of 2
    assert fit.largest_fitting({1.5: 10 * GIB, 3.0: 20 * GIB}, 16 * GIB, _Compiler(_linear), 0) == 0


def test_a_candidate_already_known_is_not_compiled_again() -> None:
    chip = _Compiler(_linear)
    # the asked 14 rows fill 16 GiB exactly: the line's candidate is the asked batch
    assert fit.largest_fitting(_known(_linear, 7.0, 14.0), 16 * GIB, chip, 4) == 14
    assert chip.compiled == [15]
    # both sides known already: no compile at all
    done = _Compiler(_linear)
    assert fit.largest_fitting(_known(_linear, 14.0, 15.0), 16 * GIB, done, 4) == 14
    assert done.compiled == []
    # the candidate known to be over the chip (6 rows), the row below it known to fit: nothing compiled
    below = _Compiler(_linear)
    peaks = {2.0: 4 * GIB, 5.0: 7 * GIB, 6.0: 8 * GIB + 1, 10.0: 12 * GIB}
    assert fit.largest_batch(list(peaks.items()), 8 * GIB) == 6
    assert fit.largest_fitting(peaks, 8 * GIB, below, 4) == 5
    assert below.compiled == []


def test_a_queued_step_adds_one_copy_of_what_the_step_writes_anew() -> None:
    # 1.5 B LoRA on a v5e chip as Tunix's own step compiled (the optimizer donated, not the model): outputs
    # 2.85 GiB, 0.04 of them over the donated optimizer; the one-step peak 8.15 GiB becomes 10.97 queued
    step_peak, outputs, aliased = 8_756_228_608, 3_064_612_864, 45_090_304
    assert fit.queued_peak(step_peak, outputs, aliased, 3_019_510_372) == 11_775_751_168
    # never below the set-up's peak (MaxText's set-up holding the bf16 model on a chip)
    assert fit.queued_peak(2 * GIB, GIB, GIB // 2, 4 * GIB) == 4 * GIB
    assert fit.queued_peak(4 * GIB, GIB, GIB // 2, 5 * GIB - GIB // 2) == 5 * GIB - GIB // 2
    assert fit.queued_peak(4 * GIB, GIB, GIB // 2, 4 * GIB) == 4 * GIB + GIB // 2


def test_the_verdict_says_fits_and_by_how_much() -> None:
    assert fit.verdict(10 * GIB, 16 * GIB, 14) == fit.Verdict(True, 6 * GIB, 14)
    assert fit.verdict(16 * GIB, 16 * GIB, 8) == fit.Verdict(True, 0, 8)  # exactly full still fits
    assert fit.verdict(17 * GIB, 16 * GIB, 3) == fit.Verdict(False, -GIB, 3)


def test_fit_on_a_spec_without_tpu_compute_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(PIPELINES / "tiny-llama-lora.yaml"), "--fit"]) == 1
    err = capsys.readouterr().err
    assert "compute.lora_sft runs on no TPU (launcher local)" in err
    assert "machine_type e.g. ct5lp-hightpu-1t, tpu_topology e.g. 1x1" in err


def test_fit_on_an_unknown_tpu_names_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, TPU + "    machine_type: ct9x-hightpu-4t\n    tpu_topology: 2x2\n")
    assert main(["plan", str(spec), "--fit"]) == 1
    assert "ct9x-hightpu-4t: no TPU generation loraflow knows" in capsys.readouterr().err


def _answer(fits: bool, largest: int) -> dict[str, Any]:
    step = {"argument_bytes": 3 * GIB, "output_bytes": 3 * GIB, "alias_bytes": GIB // 2, "temp_bytes": 2 * GIB}
    peak = 7 * GIB + GIB // 2 if fits else 18 * GIB
    return {
        "slice": "v5e-4",
        "describe": "TPU v5e 2x2 (4 chips)",
        "chips": 4,
        "hbm_bytes": 16 * GIB,
        "hbm_source": "measured",
        "asked": {
            "per_device_batch": 2.0,
            "step": step,
            "setup_bytes": GIB,
            "peak_bytes": peak,
            "queued_bytes": peak + 5 * GIB // 2,
        },
        "peaks": [[2.0, peak], [4.0, peak + GIB]],
        "verdict": {"fits": fits, "margin_bytes": 16 * GIB - peak, "largest_batch": largest},
    }


def test_fit_prints_the_peak_the_verdict_and_the_largest_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: dict[str, Any] = {}

    def run_fit(config: dict[str, Any], machine_type: str, topology: str) -> dict[str, Any]:
        asked.update(config=config, machine_type=machine_type, topology=topology)
        return _answer(True, 6)

    monkeypatch.setattr(commands, "run_fit", run_fit)
    spec = _spec(tmp_path, TPU + "    machine_type: ct5lp-hightpu-4t\n    tpu_topology: 2x2\n")
    assert main(["plan", str(spec), "--fit"]) == 0
    out = capsys.readouterr().out
    # the trainer is asked about the spec's own lora_sft config on its slice
    assert asked["machine_type"] == "ct5lp-hightpu-4t" and asked["topology"] == "2x2"
    assert asked["config"]["quantization"] == "nf4" and asked["config"]["model_name"] == "llama3.1-8b"
    assert "lora_sft on TPU v5e 2x2 (4 chips), 16.00 GiB of HBM per chip" in out
    assert "batch 8 (2 per chip) x 128 tokens, float32, quantization nf4: predicted peak 7.50 GiB per chip" in out
    assert "(up to 10.00 GiB while a second step is queued, where the chip has room for it)" in out
    assert "outputs 2.50 GiB not over donated ones, temporaries 2.00 GiB; set-up 1.00 GiB" in out
    assert "fits: 8.50 GiB to spare" in out
    assert "largest per-device batch that fits: 6 (training.batch_size 24)" in out
    # the step writes nothing of its own beyond a few scalars (the model donated): no queued figure
    answer = _answer(True, 6)
    answer["asked"]["queued_bytes"] = answer["asked"]["peak_bytes"] + 5120
    monkeypatch.setattr(commands, "run_fit", lambda *a: answer)
    assert main(["plan", str(spec), "--fit"]) == 0
    out = capsys.readouterr().out
    assert "predicted peak 7.50 GiB per chip\n" in out and "queued" not in out
    assert "host's memory" not in out  # nothing offloaded
    answer["asked"]["step"]["host_bytes"] = 19 * GIB  # a remat policy that offloads (minimal_offloaded at 8B)
    assert main(["plan", str(spec), "--fit"]) == 0
    out = capsys.readouterr().out
    assert (
        "temporaries 2.00 GiB; set-up 1.00 GiB\n    and 19.00 GiB per chip in the host's memory (what the remat "
        "policy offloads), not in the peak: a host's memory must hold it for each of its chips\n" in out
    )
    assert "fits: 8.50 GiB to spare" in out  # the chip's verdict, the host's bytes not in it


def test_fit_says_when_it_does_not_fit_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(tmp_path, TPU + "    machine_type: ct5lp-hightpu-4t\n    tpu_topology: 2x2\n")
    monkeypatch.setattr(commands, "run_fit", lambda *a: _answer(False, 0))
    assert main(["plan", str(spec), "--fit"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit: 2.00 GiB short\n" in out
    assert "no batch fits: not even one row per chip" in out
    monkeypatch.setattr(commands, "run_fit", lambda *a: _answer(False, 1))
    assert main(["plan", str(spec), "--fit", "--json"]) == 1
    assert '"largest_batch": 1' in capsys.readouterr().out


def test_a_failed_prediction_is_an_error_not_a_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer environment's refusal (e.g. a topology MaxText does not know) reaches the user as it is."""
    import subprocess

    spec = _spec(tmp_path, TPU + "    machine_type: ct5lp-hightpu-4t\n    tpu_topology: 3x5\n")
    said = '{"error": "compute.lora_sft.tpu_topology 3x5: MaxText knows no v5e slice of 15 chips"}'

    def ran(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert argv[1:3] == ["-m", "loraflow.trainer.fit"] and argv[-2:] == ["--topology", "3x5"]
        return subprocess.CompletedProcess(argv, 1, said + "\n", "")

    monkeypatch.setattr(subprocess, "run", ran)
    assert main(["plan", str(spec), "--fit"]) == 1
    assert "error: compute.lora_sft.tpu_topology 3x5: MaxText knows no v5e slice" in capsys.readouterr().err
    monkeypatch.setattr(
        subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "Traceback\nBoom")
    )
    assert main(["plan", str(spec), "--fit"]) == 1
    assert "the prediction failed in the trainer environment (exit 1):\nTraceback\nBoom" in capsys.readouterr().err


def test_fit_with_tuning_auto_names_the_policy_chosen_and_each_candidates_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: dict[str, Any] = {}
    answer = _answer(True, 6)
    answer["tuning"] = {
        "remat_policy": "save_dot_except_mlp",
        "fits": True,
        "peaks": {"minimal": 17 * GIB, "save_dot_except_mlp": 15 * GIB, "full": 7 * GIB},
    }

    def run_fit(config: dict[str, Any], machine_type: str, topology: str) -> dict[str, Any]:
        sent.update(config)
        return answer

    monkeypatch.setattr(commands, "run_fit", run_fit)
    spec = _spec(tmp_path, TPU + "    machine_type: ct5lp-hightpu-4t\n    tpu_topology: 2x2\n")
    spec.write_text(spec.read_text().replace("training:\n", "training:\n  tuning: auto\n", 1))
    assert main(["plan", str(spec), "--fit"]) == 0
    assert sent["tuning"] == "auto"  # the trainer is asked about the spec's own config, tuning in it
    out = capsys.readouterr().out
    assert (
        "  training.tuning: auto: remat_policy=save_dot_except_mlp (the first that fits, least recomputed first); "
        "predicted peaks: minimal 17.00 GiB, save_dot_except_mlp 15.00 GiB, full 7.00 GiB\n"
    ) in out
    answer["tuning"] = {**answer["tuning"], "remat_policy": "full", "fits": False}
    assert main(["plan", str(spec), "--fit"]) == 0
    assert "remat_policy=full (none fits: MaxText's default)" in capsys.readouterr().out
    del answer["tuning"]
    assert main(["plan", str(spec), "--fit"]) == 0
    assert "tuning" not in capsys.readouterr().out
