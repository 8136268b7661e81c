"""qwix's abs-max calibration with the abs kept apart (loraflow.trainer.abs_max): qwix's own scales, bit for
bit. That the host build calibrates through it, to the model MaxText builds, is checked in test_lora_apply.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

pytest.importorskip("qwix")


def _kernel(dtype: str) -> Any:
    """A 128 x 96 kernel of normal values with a tile of each kind that could go wrong: all zeros (both signs),
    a NaN, an infinity of each sign, subnormals, and a negative value larger than any positive one."""
    import jax.numpy as jnp
    import numpy as np

    w = np.random.default_rng(0).standard_normal((128, 96)).astype(np.float32)
    w[0:32, 0] = 0.0
    w[0:32:2, 0] = -0.0
    w[32:64, 1] = 0.0
    w[40, 1] = np.nan
    w[70, 2], w[100, 3] = np.inf, -np.inf
    w[0:32, 4] = np.float32(1e-39)  # subnormal in float32 and (as 0 or subnormal) in bf16
    w[64:96, 5] = -9.0
    return jnp.asarray(w.astype(jnp.bfloat16 if dtype == "bfloat16" else dtype))


def _bits(x: Any) -> Any:
    import numpy as np

    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    ("tiled", "channelwise"), [({0: 32}, ()), ({0: 32}, (1,)), ({}, (1,)), ({}, ()), ({0: 64, 1: 32}, ())]
)
def test_the_scales_are_qwix_s_bit_for_bit(dtype, tiled, channelwise):
    """qwix's quantization of a kernel (its scale and its values) with the abs kept apart: qwix's own, bit for
    bit, tiled, per channel or per tensor; and qwix's calibrate is back afterwards."""
    import jax
    import numpy as np
    from qwix._src.core import qarray

    from loraflow.trainer import abs_max

    w = _kernel(dtype)

    def quantized(x: Any) -> Any:
        q = qarray.quantize_api(x, "nf4", tiled_axes=tiled, channelwise_axes=channelwise)
        return q.qvalue, q.scale

    qwix_calibrate = qarray.calibrate
    expected = jax.jit(quantized)(w)
    with abs_max.abs_apart():
        assert qarray.calibrate is not qwix_calibrate
        got = jax.jit(quantized)(w)
    assert qarray.calibrate is qwix_calibrate
    assert got[1].dtype == expected[1].dtype and got[1].shape == expected[1].shape
    assert np.array_equal(_bits(got[1]), _bits(expected[1]))
    assert np.array_equal(np.asarray(got[0]).astype(np.uint8), np.asarray(expected[0]).astype(np.uint8))


def test_the_abs_max_has_the_abs_apart_from_the_max():
    """What the module is for: an optimization barrier between the abs and the max (the values alone cannot
    show it), and the abs-max qwix's: 9 for a tile whose largest magnitude is a -9."""
    import jax
    import numpy as np
    from qwix._src.core import qarray

    from loraflow.trainer import abs_max

    how = qarray.HowToQuantize(qtype="nf4", tiled_axes={0: 32}, channelwise_axes=(1,), calibration_method="absmax")
    calibrate = abs_max.apart(qarray.calibrate)
    w = _kernel("bfloat16")
    text = jax.jit(lambda x: calibrate(x, how)).lower(w).as_text()
    assert "optimization_barrier" in text and "abs" in text
    absmax = np.asarray(jax.jit(lambda x: calibrate(x, how))(w)["absmax"], dtype=np.float32)
    assert absmax.shape == (4, 96) and absmax[2, 5] == 9.0 and np.isnan(absmax[1, 1]) and absmax[0, 0] == 0.0
    assert not np.signbit(absmax[0, 0]) and absmax[2, 2] == absmax[3, 3] == np.inf


@pytest.mark.parametrize("method", ["minmax", "absmax,0.5", "rms,2", "fixed,-1,1"])
def test_another_calibration_goes_to_qwix_as_it_is(method):
    from qwix._src.core import qarray

    from loraflow.trainer import abs_max

    calls: list[tuple[Any, Any]] = []

    def qwix_calibrate(array: Any, how: Any) -> dict[str, Any]:
        calls.append((array, how))
        return {"qwix's": array}

    how = qarray.HowToQuantize(qtype="nf4", tiled_axes={}, channelwise_axes=(), calibration_method=method)
    w = _kernel("float32")
    assert abs_max.apart(qwix_calibrate)(w, how) == {"qwix's": w}
    assert len(calls) == 1 and calls[0][0] is w and calls[0][1] is how


def test_qwix_s_calibrate_is_back_after_a_failure():
    from qwix._src.core import qarray

    from loraflow.trainer import abs_max

    qwix_calibrate = qarray.calibrate
    with pytest.raises(RuntimeError, match="quantization failed"), abs_max.abs_apart():
        assert qarray.calibrate is not qwix_calibrate
        raise RuntimeError("quantization failed")
    assert qarray.calibrate is qwix_calibrate
