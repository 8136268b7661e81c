"""qwix's nf4 quantization by a table (loraflow.trainer.nf4_table): qwix's own values for every bf16 input.
That the host build quantizes through it, to the model MaxText builds, is checked in test_lora_apply.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

pytest.importorskip("qwix")


def _every_bf16() -> Any:
    """Every bf16 bit pattern, as a 256 x 256 array (row ``i`` holds the patterns ``256 i`` to ``256 i + 255``)."""
    import jax.numpy as jnp
    import numpy as np

    return np.arange(1 << 16, dtype=np.uint16).view(jnp.bfloat16).reshape(256, 256)


def _cpu() -> Any:
    import jax

    return jax.local_devices(backend="cpu")[0]


def test_every_bf16_value_is_quantized_as_qwix_quantizes_it():
    """All 65,536 bf16 values (NaN, infinities, subnormals, both zeros among them), through qwix's quantization
    entry point while the table is in place: qwix's own 4-bit values, dtype and shape."""
    import jax
    import numpy as np
    from qwix._src.core import numerics

    from loraflow.trainer import nf4_table

    values = _every_bf16()
    qwix_nf4 = numerics.fp_to_nf4
    expected = jax.jit(qwix_nf4)(values)
    with nf4_table.by_table(_cpu()):
        assert numerics.fp_to_nf4 is not qwix_nf4
        got = jax.jit(lambda x: numerics.convert_to(x, "nf4"))(values)
    assert got.dtype == expected.dtype == np.dtype("uint4") and got.shape == expected.shape == (256, 256)
    assert np.array_equal(np.asarray(got).astype(np.uint8), np.asarray(expected).astype(np.uint8))
    assert numerics.fp_to_nf4 is qwix_nf4
    # the values take every level: a table of one level, or of a few, would not pass
    assert set(np.unique(np.asarray(expected).astype(np.uint8))) == set(range(16))


def test_a_bf16_value_reads_its_own_entry_of_the_table():
    """The lookup goes by the value's 16 bits: a table whose entries are not nf4's shows which entry each
    value read (qwix's function is not called for bf16)."""
    import jax
    import numpy as np

    from loraflow.trainer import nf4_table

    levels = np.random.default_rng(0).integers(0, 16, 1 << 16, dtype=np.uint8)

    def qwix_nf4(array: Any) -> Any:
        raise AssertionError("a bf16 array went to qwix's function")

    values = _every_bf16()
    got = jax.jit(nf4_table.looked_up(levels, qwix_nf4))(values)
    assert got.dtype == np.dtype("uint4") and got.shape == (256, 256)
    assert np.array_equal(np.asarray(got).astype(np.uint8), levels.reshape(256, 256))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_value_of_another_dtype_is_quantized_by_qwix_s_function(dtype):
    """Only bf16 has the table's 16 bits: a float32 value between two bf16 values, or a float16 one with the
    same bits as a bf16 one, would read another value's entry."""
    import numpy as np

    from loraflow.trainer import nf4_table

    calls: list[Any] = []

    def qwix_nf4(array: Any) -> Any:
        calls.append(array)
        return "qwix's"

    values = np.linspace(-1, 1, 7, dtype=dtype)
    assert nf4_table.looked_up(np.zeros(1 << 16, np.uint8), qwix_nf4)(values) == "qwix's"
    assert len(calls) == 1 and calls[0] is values


def test_the_table_is_qwix_s_function_of_each_value_on_the_device_given(monkeypatch):
    import jax
    import numpy as np

    from loraflow.trainer import nf4_table

    seen: list[Any] = []

    def fake_nf4(array: Any) -> Any:  # the bits' low four, so that every entry is known
        seen.append(array)
        return jax.lax.bitcast_convert_type(array, np.uint16) % 16

    levels = nf4_table.table(fake_nf4, _cpu())
    assert levels.dtype == np.uint8 and levels.shape == (1 << 16,)
    assert np.array_equal(levels, np.arange(1 << 16) % 16)
    assert len(seen) == 1  # traced once, under jit

    placed: list[Any] = []
    put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, device=None, **kw: placed.append(device) or put(x, device, **kw))
    nf4_table.table(fake_nf4, _cpu())
    assert placed == [_cpu()]


def test_qwix_s_function_is_back_after_the_table_even_when_the_quantization_fails():
    from qwix._src.core import numerics

    from loraflow.trainer import nf4_table

    qwix_nf4 = numerics.fp_to_nf4
    with pytest.raises(RuntimeError, match="quantization failed"), nf4_table.by_table(_cpu()):
        assert numerics.fp_to_nf4 is not qwix_nf4
        raise RuntimeError("quantization failed")
    assert numerics.fp_to_nf4 is qwix_nf4
