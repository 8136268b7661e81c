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


def _tune(peaks: dict[str, int]) -> tuple[tuning.Choice, list[str]]:
    """tune() on a 16 GiB chip with each candidate's peak in GiB (7 for one not named), and the candidates it
    predicted (each prediction is a compile of the train step on the chip), in the order it asked."""
    asked: list[str] = []

    def peak_of(policy: str) -> int:
        asked.append(policy)
        return peaks.get(policy, 7) * GIB

    return tuning.tune(peak_of, HBM), asked


def test_tune_compiles_only_the_first_candidate_when_it_fits() -> None:
    choice, asked = _tune({"minimal": 11, "full": 5})
    assert asked == ["minimal"]  # full is not compiled beside it: the choice does not need it
    assert choice.policy == "minimal" and choice.fits and choice.peaks == {"minimal": 11 * GIB}
    assert choice.note() == "tuning: remat_policy=minimal (predicted 11.0 GiB of 16.0 GiB)"


def test_tune_predicts_in_order_until_one_fits_and_none_after_it() -> None:
    choice, asked = _tune({"minimal": 20, "save_dot_except_mlpwi": 15, "save_dot_except_mlp": 9, "full": 5})
    assert asked == ["minimal", "save_dot_except_mlpwi"]
    assert choice.policy == "save_dot_except_mlpwi" and choice.fits
    assert choice.peaks == {"minimal": 20 * GIB, "save_dot_except_mlpwi": 15 * GIB}
    assert choice.note() == (
        "tuning: remat_policy=save_dot_except_mlpwi (predicted 15.0 GiB of 16.0 GiB; did not fit: minimal 20.0 GiB)"
    )
    assert choice.summary() == {
        "tuning_remat_policy": "save_dot_except_mlpwi",
        "tuning_fits": True,
        "tuning_hbm_bytes": HBM,
        "tuning_peak_bytes": {"minimal": 20 * GIB, "save_dot_except_mlpwi": 15 * GIB},
    }


def test_the_note_names_every_candidate_that_did_not_fit_in_order() -> None:
    choice, asked = _tune({"minimal": 30, "save_dot_except_mlpwi": 20, "save_dot_except_mlp": 16, "save_qkv_proj": 2})
    assert asked == ["minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj"]
    assert choice.note() == (
        "tuning: remat_policy=save_qkv_proj (predicted 2.0 GiB of 16.0 GiB; did not fit: minimal 30.0 GiB, "
        "save_dot_except_mlpwi 20.0 GiB, save_dot_except_mlp 16.0 GiB)"
    )


def test_the_note_of_plan_fits_choice_names_no_candidate_after_the_chosen_one() -> None:
    """plan --fit predicts every candidate (decided() on all six): the note still names only those before the
    chosen one, which did not fit, and no comparison with full."""
    peaks = dict.fromkeys(tuning.CANDIDATES, 3 * GIB) | {"minimal": 17 * GIB}
    choice = tuning.decided(peaks, HBM)
    assert choice.policy == "save_dot_except_mlpwi" and choice.peaks == peaks
    assert choice.note() == (
        "tuning: remat_policy=save_dot_except_mlpwi (predicted 3.0 GiB of 16.0 GiB; did not fit: minimal 17.0 GiB)"
    )


def test_tune_keeps_full_and_says_so_when_nothing_fits() -> None:
    asked: list[str] = []
    choice = tuning.tune(lambda policy: asked.append(policy) or HBM + 1, HBM)
    assert choice.policy == "full" and not choice.fits
    assert asked == list(tuning.CANDIDATES)  # all six compiled, each once, full last
    assert list(choice.peaks) == list(tuning.CANDIDATES)
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
    over = ", ".join(f"{p} 16.0 GiB" for p in tuning.CANDIDATES[:-1])
    assert choice.note() == f"tuning: remat_policy=full (predicted 16.0 GiB of 16.0 GiB; did not fit: {over})"


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
