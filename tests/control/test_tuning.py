"""training.tuning: the spec key, its refusal beside model_overrides.remat_policy, the training key it
moves, and the pure choice of the remat policy (loraflow/spec/tuning.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loraflow.errors import SpecError
from loraflow.pipeline import plan
from loraflow.spec import tuning
from loraflow.spec.fit import GIB
from loraflow.spec.schema import validate_spec
from loraflow.spec.step_configs import LoraSftConfig, parse

TINY = Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml"
HBM = 16 * GIB


def tiny_data() -> dict:
    return yaml.safe_load(TINY.read_text())


def test_auto_beside_a_remat_policy_override_is_refused_naming_both_and_the_fix() -> None:
    data = tiny_data()
    data["training"]["tuning"] = "auto"
    data["base_model"]["model_overrides"] = {**data["base_model"].get("model_overrides", {}), "remat_policy": "minimal"}
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    text = str(err.value)
    assert "training.tuning: auto" in text and "base_model.model_overrides.remat_policy" in text
    assert (
        "training.tuning: auto chooses MaxText's remat_policy itself, but base_model.model_overrides.remat_policy "
        "sets it (minimal); remove base_model.model_overrides.remat_policy, or set training.tuning: off to train "
        "with the policy you name"
    ) in text


def test_off_keeps_the_remat_policy_override_and_auto_passes_without_one() -> None:
    data = tiny_data()
    data["base_model"]["model_overrides"] = {**data["base_model"].get("model_overrides", {}), "remat_policy": "minimal"}
    assert validate_spec(data, "x.yaml").training.tuning == "off"
    data = tiny_data()
    data["training"]["tuning"] = "auto"
    assert validate_spec(data, "x.yaml").training.tuning == "auto"


def test_a_tuning_of_another_value_is_refused_at_its_key() -> None:
    data = tiny_data()
    data["training"]["tuning"] = "fast"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert any(p == "training.tuning" and "'off' or 'auto'" in m for p, m in err.value.problems), err.value.problems


def test_auto_moves_the_training_key_and_off_keeps_the_one_from_before_tuning() -> None:
    off = plan.stage_plans(validate_spec(tiny_data(), "x.yaml"))["lora_sft"].config
    assert "tuning" not in off  # a spec that leaves tuning out sends what it sent before the key existed
    assert parse(LoraSftConfig, off).tuning == "off"
    data = tiny_data()
    data["training"]["tuning"] = "auto"
    auto = plan.stage_plans(validate_spec(data, "x.yaml"))["lora_sft"].config
    assert auto == {**off, "tuning": "auto"}
    assert parse(LoraSftConfig, auto).tuning == "auto"


def test_the_candidates_go_from_most_kept_to_full() -> None:
    assert tuning.CANDIDATES[0] == "minimal" and tuning.CANDIDATES[-1] == tuning.FALLBACK == "full"
    assert len(set(tuning.CANDIDATES)) == len(tuning.CANDIDATES)


def test_choose_takes_the_first_candidate_that_fits_in_the_fixed_order() -> None:
    peaks = {"full": 5 * GIB, "save_qkv_proj": 12 * GIB, "minimal": 17 * GIB, "save_dot_except_mlp": 14 * GIB}
    assert tuning.choose(peaks, HBM) == "save_dot_except_mlp"  # minimal is over, the next one fits
    # a candidate leaves 5 % of the chip free (the prediction ran up to 4.4 % under the chip): at that, it fits
    assert tuning.choose({**peaks, "minimal": HBM - HBM // 20}, HBM) == "minimal"
    assert tuning.choose({**peaks, "minimal": HBM - HBM // 20 + 1}, HBM) == "save_dot_except_mlp"
    assert tuning.choose({"full": HBM, "minimal": HBM}, HBM) == "full"  # full as plan --fit says: it runs anyway
    assert tuning.choose({"full": HBM + 1, "minimal": HBM + 2}, HBM) is None


def test_tune_predicts_in_order_until_one_fits_then_full_beside_it() -> None:
    asked: list[str] = []
    peaks = {"minimal": 20, "save_dot_except_mlpwi": 15, "save_dot_except_mlp": 9, "full": 5}

    def peak_of(policy: str) -> int:
        asked.append(policy)
        return peaks.get(policy, 7) * GIB

    choice = tuning.tune(peak_of, HBM)
    assert asked == ["minimal", "save_dot_except_mlpwi", "full"]
    assert choice.policy == "save_dot_except_mlpwi" and choice.fits
    assert choice.peaks == {"minimal": 20 * GIB, "save_dot_except_mlpwi": 15 * GIB, "full": 5 * GIB}
    assert (
        choice.note()
        == "tuning: remat_policy=save_dot_except_mlpwi (predicted 15.0 GiB of 16.0 GiB; full would be 5.0 GiB)"
    )
    assert choice.summary() == {
        "tuning_remat_policy": "save_dot_except_mlpwi",
        "tuning_fits": True,
        "tuning_hbm_bytes": HBM,
        "tuning_peak_bytes": choice.peaks,
    }


def test_tune_keeps_full_and_says_so_when_nothing_fits() -> None:
    choice = tuning.tune(lambda policy: HBM + 1, HBM)
    assert choice.policy == "full" and not choice.fits
    assert list(choice.peaks) == list(tuning.CANDIDATES)  # every candidate tried, full once
    tried = ", ".join(f"{p} 16.0 GiB" for p in tuning.CANDIDATES)
    assert choice.note() == (
        "tuning: remat_policy=full, MaxText's default: no candidate is predicted to fit 16.0 GiB "
        f"({tried}); training as without tuning"
    )
    assert choice.summary()["tuning_fits"] is False


def test_tune_on_full_alone_is_predicted_once() -> None:
    asked: list[str] = []
    peaks = dict.fromkeys(tuning.CANDIDATES, HBM + 1) | {"full": HBM}
    choice = tuning.tune(lambda p: asked.append(p) or peaks[p], HBM)
    assert choice.policy == "full" and choice.fits
    assert asked == list(tuning.CANDIDATES)
    assert choice.note() == "tuning: remat_policy=full (predicted 16.0 GiB of 16.0 GiB)"


def test_with_no_memory_limit_the_first_candidate_is_chosen_without_compiling() -> None:
    def never(policy: str) -> int:
        raise AssertionError("nothing is compiled when the devices report no limit")

    choice = tuning.tune(never, None)
    assert choice.policy == "minimal" and choice.peaks == {} and choice.hbm_bytes is None
    assert choice.note() == (
        "tuning: remat_policy=minimal (the devices report no memory limit, as on a CPU: the first candidate, "
        "nothing compiled)"
    )


def test_the_run_report_names_the_policy_tuning_trained_with() -> None:
    from loraflow.reporting.report import _training_section

    summary = {"steps": 10, "tuning_remat_policy": "save_qkv_proj", "tuning_peak_bytes": {"minimal": 1}}
    assert "training.tuning: auto trained with remat_policy save_qkv_proj" in _training_section(
        {"training_summary": summary}
    )
    assert "tuning" not in _training_section({"training_summary": {"steps": 10}})
