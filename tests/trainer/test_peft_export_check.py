"""The PEFT export checks its layout against MaxText's own MaxText->HF hooks, and refuses a mismatch.

The check runs on the first and the last layer of each module's stack (``loraflow/models/peft_layout.py``
says why not on every layer); a layout that is wrong there must stop the export, not reach the merge.
"""

from __future__ import annotations

import pytest

from loraflow.dev import tinymodel
from loraflow.errors import LoraflowError
from loraflow.models import llama, peft_layout

LAYERS, RANK = 4, 2


def _mt_config():
    from maxtext.configs import pyconfig

    from loraflow.trainer.argv import overrides_args

    overrides = {**tinymodel.MAXTEXT_OVERRIDES, "base_num_decoder_layers": LAYERS}
    argv = [
        "x",
        *overrides_args(tinymodel.MAXTEXT_MODEL, overrides),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
    ]
    return pyconfig.initialize([*argv, "scan_layers=true", "attention=dot_product"])


def _adapter():
    """A scanned query adapter of LAYERS layers (the layer axis is MaxText's param_scan_axis, 1)."""
    import numpy as np

    rng = np.random.default_rng(0)
    emb, heads, head_dim = (tinymodel.DIMS[k] for k in ("hidden_size", "num_attention_heads", "head_dim"))
    path = ("decoder", "layers", "self_attention", "query")
    return {
        (*path, "kernel_lora_a", "value"): rng.standard_normal((emb, LAYERS, RANK)).astype("float32"),
        (*path, "kernel_lora_b", "value"): rng.standard_normal((RANK, LAYERS, heads * head_dim)).astype("float32"),
    }


def _hf_config():
    import transformers

    return transformers.LlamaConfig(**{**tinymodel.hf_config(), "num_hidden_layers": LAYERS})


def test_a_correct_export_passes_its_check() -> None:
    modules, err = llama.FAMILY.peft_modules(_adapter(), _mt_config(), _hf_config(), 2.0)
    assert sorted(modules) == sorted(f"model.layers.{n}.self_attn.q_proj" for n in range(LAYERS))
    assert err < 1e-5


@pytest.mark.parametrize("bad_layer", [0, LAYERS - 1])
def test_a_layout_that_disagrees_with_maxtexts_hooks_is_refused(monkeypatch, bad_layer: int) -> None:
    """lora_B with its output rows out of order (as a wrong head reshape would leave it) on the stack's
    first or last layer: the export fails naming the HF module, before anything is written."""
    import numpy as np

    right = peft_layout._peft_factors
    calls = []

    def scrambled(a, b, out_shape, hooks):
        lora_a, lora_b = right(a, b, out_shape, hooks)
        calls.append(None)
        return (lora_a, np.roll(lora_b, 1, axis=0)) if len(calls) - 1 == bad_layer else (lora_a, lora_b)

    monkeypatch.setattr(peft_layout, "_peft_factors", scrambled)
    with pytest.raises(LoraflowError, match=rf"PEFT export check failed for model\.layers\.{bad_layer}\.self_attn"):
        llama.FAMILY.peft_modules(_adapter(), _mt_config(), _hf_config(), 2.0)


def _export_watching_devices(monkeypatch, tmp_path):
    """The export of the scanned query adapter, and JAX's default device at each layer's check."""
    import jax

    from loraflow.trainer import export

    right, seen = peft_layout._check_factors, []

    def watched(*args, **kwargs):
        seen.append(jax.config.jax_default_device)
        return right(*args, **kwargs)

    monkeypatch.setattr(peft_layout, "_check_factors", watched)
    return export.export_peft(_nested(_adapter()), _mt_config(), _hf_config(), RANK, 4.0, tmp_path), seen


def test_the_export_and_its_check_run_on_the_host_not_beside_the_trained_model(monkeypatch, tmp_path) -> None:
    """MaxText's hooks use jax.numpy (Llama's RoPE layout): under the export every JAX array made by default
    is on the host's CPU, so on an accelerator the check's full deltas take none of its memory."""
    import jax

    exported, seen = _export_watching_devices(monkeypatch, tmp_path)
    assert exported.tensors == 2 * LAYERS and len(seen) == 2  # the first and the last layer checked
    assert all(d is not None and d.platform == "cpu" for d in seen), seen
    assert jax.config.jax_default_device is None  # and only while it exports


def test_the_export_checks_on_the_default_device_where_jax_has_no_cpu_backend(monkeypatch, tmp_path) -> None:
    """A spec's JAX_PLATFORMS may leave the CPU out (tpu): the export still runs, after the training, on
    JAX's default device, rather than failing a finished run; QLoRA's host build, before any training,
    refuses such a process naming the fix."""
    import jax

    from loraflow.trainer import host_build

    def no_cpu(backend=None, **kwargs):
        raise RuntimeError(f"Unknown backend {backend}")

    monkeypatch.setattr(jax, "local_devices", no_cpu)
    exported, seen = _export_watching_devices(monkeypatch, tmp_path)
    assert exported.tensors == 2 * LAYERS and seen == [None, None]
    with pytest.raises(LoraflowError, match=r"JAX has no CPU backend here: let JAX_PLATFORMS include cpu"):
        host_build._host_devices()


def _nested(flat):
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
