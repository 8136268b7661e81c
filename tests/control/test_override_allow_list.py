"""The MaxText settings a spec may override (loraflow/spec/override_rules.py), checked directly: each
model family's shape keys, the bounds of a whole number (both ends taken), the refusals' words.
(tests/trainer/test_override_rules.py holds the list to MaxText's own settings.)"""

from __future__ import annotations

from loraflow import models
from loraflow.spec import override_rules


def test_each_familys_shape_keys_take_whole_numbers_from_1_to_2_to_the_20() -> None:
    shape = override_rules._shape()
    assert set(shape) == {key for family in models.FAMILIES for key in family.overrides.values()}
    for key, entry in shape.items():
        assert (entry.kind, entry.minimum, entry.maximum) == (int, 1, 2**20), key
        assert entry.reason.startswith("the model's shape: its ") and "OVERRIDES)" in entry.reason
    assert shape["sliding_window_size"].reason == (
        "the model's shape: its sliding_window (loraflow/models/gemma3.py OVERRIDES)"
    )
    assert [v for v in (0, 1, 2**20, 2**20 + 1, True, 8.0, "8") if shape["head_dim"].takes(v)] == [1, 2**20]


def test_a_whole_number_takes_both_its_bounds_and_nothing_beyond() -> None:
    blocks = override_rules.ALLOWED["sa_block_q"]
    assert [override_rules.problem("sa_block_q", v) is None for v in (0, 1, 2**16, 2**16 + 1)] == [
        False, True, True, False,
    ]  # fmt: skip
    assert blocks.values() == "a whole number from 1 to 65536"
    assert override_rules.problem("ici_fsdp_parallelism", -1) is None  # -1: the rest of the devices


def test_a_refusal_names_the_rule() -> None:
    assert override_rules.problem("compile_xla_flags", "x") == (
        "is not on the allow-list of MaxText settings a spec may override"
    )
    assert override_rules.problem("Head_Dim", 8) == "is not a MaxText setting name (lowercase letters, digits and '_')"
    assert override_rules.problem("attention", "paged") == (
        "the value 'paged' is not one of autoselected, dot_product, flash, cudnn_flash_te"
    )
    assert override_rules.problem("float32_logits", 1) == "the value 1 is not true or false"


def test_no_override_points_a_writer_outside_the_run() -> None:
    """MaxText's own writers (TensorBoard, metrics, checkpoints, profiles, HLO dumps) take a folder: none of
    their settings is on the allow-list, so a spec cannot send what a run writes outside its artifact prefix."""
    writers = [
        "tensorboard_dir", "enable_tensorboard", "base_output_directory", "run_name", "metrics_dir", "metrics_file",
        "checkpoint_dir", "dump_hlo_gcs_dir", "dump_hlo_local_dir", "profiler", "managed_mldiagnostics_dir",
    ]  # fmt: skip
    for key in writers:
        assert override_rules.problem(key, "gs://elsewhere/x") == (
            "is not on the allow-list of MaxText settings a spec may override"
        ), key
