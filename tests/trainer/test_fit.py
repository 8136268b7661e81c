"""Will it fit? lora_sft's train step compiled for a TPU v5e chip on this CPU (libtpu describes the chip,
none is here), the tiny model's: the prediction grows with the batch, a batch too large is refused with
the largest that fits named, a slice MaxText does not know is refused naming those it does.

The accuracy against the chip's own measured peaks (1.5 B to 8 B) is bench/fit_bench.py's, not a test:
docs/production.md, "Will it fit?"."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraflow.errors import LoraflowError
from loraflow.spec import fit as rule
from loraflow.spec.schema import load_spec
from loraflow.spec.step_configs import LoraSftConfig
from tests import jax_cache

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
V5E = rule.slice_of("ct5lp-hightpu-1t", "1x1")


@pytest.fixture(scope="module", autouse=True)
def _no_compilation_cache() -> Iterator[None]:
    """The steps compiled here, as plan --fit compiles them: never read from or kept in the session's
    persistent compilation cache (tests/jax_cache.py)."""
    with jax_cache.uncached():
        yield


@pytest.fixture(scope="module", autouse=True)
def _libtpu_env() -> Iterator[None]:
    """libtpu loaded as plan --fit loads it (several at once allowed), for the module's fixtures' compiles too."""
    from loraflow.trainer.fit import LIBTPU_ENV

    with pytest.MonkeyPatch.context() as mp:
        for key, value in LIBTPU_ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def cfg() -> LoraSftConfig:
    """The tiny QLoRA pipeline's lora_sft config, as the planner sends it, in bfloat16 (the TPU specs')."""
    spec = load_spec(PIPELINES / "tiny-llama-qlora.yaml")
    return LoraSftConfig.from_spec(spec).model_copy(update={"dtype": "bfloat16"})


@pytest.fixture(scope="module", autouse=True)
def _each_step_compiled_once() -> Iterator[None]:
    """Each of the module's steps compiled once: a prediction is a function of the config, the slice's chips and
    the per-chip batch (it sets the config's own batch size from that; the chip's memory size, which a test
    below shrinks, only judges the prediction), so a step ``sizing`` would compile again (the asked batch, a
    batch its search checks) is the one compiled before, its prediction kept; each is a real compile's."""
    from loraflow.trainer import fit

    compiled: dict[tuple[str, str, int, float, str | None], object] = {}
    real = fit.predict

    def predict(
        cfg: LoraSftConfig, target: rule.Slice, per_device_batch: float, remat_policy: str | None = None
    ) -> object:
        config = cfg.model_dump_json(exclude={"batch_size", "tuning"})  # tuning chooses remat_policy, in the key
        key = (config, target.maxtext_name, target.chips, per_device_batch, remat_policy)
        if key not in compiled:
            compiled[key] = real(cfg, target, per_device_batch, remat_policy)
        return compiled[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fit, "predict", predict)
        yield


@pytest.fixture(scope="module")
def two_batches(cfg: LoraSftConfig) -> tuple[object, object]:
    from loraflow.trainer.fit import predict

    return predict(cfg, V5E, 2.0), predict(cfg, V5E, 8.0)


def test_the_prediction_grows_with_the_batch(two_batches: tuple[object, object]) -> None:
    small, large = two_batches
    assert dataclasses.is_dataclass(small) and dataclasses.is_dataclass(large)
    s, big = dataclasses.asdict(small), dataclasses.asdict(large)  # type: ignore[arg-type]
    # the batch's six int32 arrays of 128 tokens are the only arguments that grow (6 rows more, at most:
    # the chip pads small arrays to its tiles)
    assert 0 < big["step"]["argument_bytes"] - s["step"]["argument_bytes"] <= 6 * 6 * 128 * 4
    assert big["step"]["temp_bytes"] > s["step"]["temp_bytes"]  # activations and their gradients
    assert big["peak_bytes"] > s["peak_bytes"] >= max(s["step"]["temp_bytes"], s["state_bytes"])
    assert s["state_bytes"] == big["state_bytes"] > 0
    # the model and the optimizer are donated (loraflow.trainer.donation): the step writes them over what it
    # was given (the whole state, padded to the chip's tiles); only the loss, its auxiliaries and the gradient
    # norm, a few scalars, take memory of their own (the frozen weights alone are over 500 KiB here)
    assert s["step"]["alias_bytes"] >= s["state_bytes"]
    assert 0 < s["step"]["output_bytes"] - s["step"]["alias_bytes"] <= 16 * 1024
    # QLoRA on one chip is built in host memory: the chip's set-up holds about the quantized state
    assert s["setup_bytes"] < s["peak_bytes"]
    # a second step queued holds one more copy of what the step returns, less what it writes over
    step = s["step"]
    assert s["queued_bytes"] == s["peak_bytes"] + step["output_bytes"] - step["alias_bytes"]


def test_a_batch_too_large_is_refused_with_the_largest_that_fits_named(
    cfg: LoraSftConfig, two_batches: tuple[object, object]
) -> None:
    from loraflow.trainer.fit import predict, sizing

    small, large = (dataclasses.asdict(p) for p in two_batches)  # type: ignore[call-overload]
    # a chip between the peaks at 2 and 8 rows: batch 8 does not fit, some batch from 2 to 7 does
    hbm = (small["peak_bytes"] + large["peak_bytes"]) // 2
    chip = dataclasses.replace(V5E, generation=dataclasses.replace(V5E.generation, hbm_bytes=hbm))
    result = sizing(cfg.model_copy(update={"batch_size": 8}), chip)
    verdict, peaks = result["verdict"], dict((b, p) for b, p in result["peaks"])
    assert verdict["fits"] is False and verdict["margin_bytes"] == hbm - result["asked"]["peak_bytes"] < 0
    largest = verdict["largest_batch"]
    assert 2 <= largest < 8
    assert peaks[largest] <= hbm  # compiled, not only extrapolated
    above = peaks.get(largest + 1) or predict(cfg, chip, float(largest + 1)).peak_bytes
    assert above > hbm  # and one row more does not fit


def test_a_step_xla_refuses_for_the_chip_is_a_prediction_over_its_memory(
    cfg: LoraSftConfig, two_batches: tuple[object, object]
) -> None:
    """XLA refuses to compile a step whose temporaries alone exceed the chip (CompileTimeHbmOom): that is a
    verdict (does not fit, by how much), not a failure."""
    from loraflow.trainer.fit import predict

    small = dataclasses.asdict(two_batches[0])  # type: ignore[call-overload]
    huge = predict(cfg, V5E, 65536.0)  # 8.4 M tokens a chip: the logits alone are over 16 GiB
    assert huge.step.compiled is False and small["step"]["compiled"] is True
    assert huge.step.temp_bytes > V5E.generation.hbm_bytes  # as XLA's refusal states it
    assert huge.peak_bytes > huge.step.temp_bytes + huge.state_bytes
    assert huge.step.argument_bytes > small["step"]["argument_bytes"]  # the batch's shapes counted
    assert not rule.fits(huge.peak_bytes, V5E.generation.hbm_bytes)


def test_with_tuning_auto_every_candidate_is_predicted_and_the_chosen_one_sized(cfg: LoraSftConfig) -> None:
    """plan --fit under training.tuning: auto: each remat policy's step compiled for the chip at the asked
    batch; minimal, which keeps the most of the forward, needs the most memory (the tiny model's at 8 rows
    of 128 tokens, measured here: minimal 13.8 MB, save_dot_except_mlpwi and save_dot_except_mlp 11.5,
    save_qkv_proj 11.1, save_out_proj 9.0, full 9.1: XLA's plan, not the order, decides the last two); on a
    chip minimal does not fit, the policy chosen is the first of the order that does, and the verdict is
    that policy's; on a chip none fits, full, and the verdict says it does not fit."""
    from loraflow.spec import tuning
    from loraflow.trainer.fit import sizing

    auto = cfg.model_copy(update={"batch_size": 8, "tuning": "auto"})
    roomy = sizing(auto, V5E, search=False)["tuning"]
    peaks = roomy["peaks"]
    assert list(peaks) == list(tuning.CANDIDATES) and roomy["remat_policy"] == "minimal" and roomy["fits"]
    assert peaks["minimal"] == max(peaks.values()) > peaks["full"]
    hbm = peaks["minimal"] - 1  # minimal does not fit; the next that does is chosen
    chip = dataclasses.replace(V5E, generation=dataclasses.replace(V5E.generation, hbm_bytes=hbm))
    result = sizing(auto, chip, search=False)
    expected = next(p for p in tuning.CANDIDATES if peaks[p] <= hbm)
    assert result["tuning"]["remat_policy"] == expected != "minimal"
    assert result["asked"]["peak_bytes"] == peaks[expected] and result["verdict"]["fits"] is True
    least = min(peaks.values()) - 1
    tiny = dataclasses.replace(V5E, generation=dataclasses.replace(V5E.generation, hbm_bytes=least))
    none = sizing(auto, tiny, search=False)
    assert none["tuning"]["remat_policy"] == "full" and none["tuning"]["fits"] is False
    assert none["verdict"]["fits"] is False


def test_a_slice_maxtext_does_not_know_is_refused_naming_those_it_does() -> None:
    from loraflow.trainer.fit import known_topology

    known_topology(rule.slice_of("ct5lp-hightpu-4t", "4x4"))
    with pytest.raises(LoraflowError) as err:
        known_topology(rule.slice_of("ct5lp-hightpu-4t", "3x5"))
    assert "MaxText knows no v5e slice of 15 chips (v5e-15); set one of 1x1, 2x2, 2x4, 4x4" in str(err.value)


def test_a_step_that_offloads_to_the_host_is_predicted_by_the_chips_bytes_alone() -> None:
    """XLA's peak_memory_in_bytes counts the host's memory too where the program offloads (the figures
    are the 8B nf4 step's with MaxText's custom remat offloading the MLP's wi, compiled for a v5e chip):
    the chip holds its arguments, the outputs not written over them and its temporaries."""
    from types import SimpleNamespace

    from loraflow.trainer.fit import step_figures

    def device_peak(stats: object) -> int:
        return step_figures(stats).peak_bytes

    chip = {"argument": 6_045_221_888, "output": 6_045_063_168, "alias": 6_045_058_048, "temp": 4_563_714_048}
    stats = SimpleNamespace(
        **{f"{k}_size_in_bytes": v for k, v in chip.items()},
        peak_memory_in_bytes=21_077_627_904,
        host_temp_size_in_bytes=15_032_385_536,
        host_argument_size_in_bytes=0,
        host_output_size_in_bytes=0,
    )
    assert device_peak(stats) == 6_045_221_888 + 6_045_063_168 - 6_045_058_048 + 4_563_714_048
    assert dataclasses.astuple(step_figures(stats))[:4] == (6_045_221_888, 6_045_063_168, 6_045_058_048, 4_563_714_048)
    assert step_figures(stats).host_bytes == 15_032_385_536  # said beside the peak, not in it
    for kind in ("argument", "output"):  # a host argument or output (offloaded optimizer state) as well
        moved = {**vars(stats), "host_temp_size_in_bytes": 0, f"host_{kind}_size_in_bytes": 1}
        assert device_peak(SimpleNamespace(**moved)) == device_peak(stats)
    # nothing on the host: XLA's own peak (with liveness, under the sum), or the sum where it gives none
    on_chip = {**vars(stats), "host_temp_size_in_bytes": 0, "peak_memory_in_bytes": 10_361_328_128}
    assert device_peak(SimpleNamespace(**on_chip)) == 10_361_328_128
    assert step_figures(SimpleNamespace(**on_chip)).host_bytes == 0
    assert device_peak(SimpleNamespace(**{**on_chip, "peak_memory_in_bytes": 0})) == device_peak(stats)
