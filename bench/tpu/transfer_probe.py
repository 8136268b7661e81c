"""Host-to-chip transfer rates by dtype (issue 39 item 3): where QLoRA's placement of an 8B model goes.

One array of about 1 GiB per dtype (bfloat16, uint8, uint4, and uint8 bitcast to uint4 on the chip), each put on
the first device from a JAX array on the host's CPU (as QLoRA's host build holds them) three times and waited for; prints one JSON line per dtype with the median seconds and GB/s.
Run on the chip: ``python3 bench/tpu/transfer_probe.py > $OUT/transfer.txt 2>&1``."""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

BYTES = 1 << 30


def _timed(put) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        put().block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 255, size=BYTES, dtype=np.uint8)
    cases = {
        "bfloat16": raw.view(np.uint16).view(jnp.bfloat16).reshape(-1, 4096),
        "uint8": raw.reshape(-1, 4096),
        "uint4": (raw & 15).astype(jnp.uint4).reshape(-1, 4096)[: BYTES // 8192 * 2],
    }
    for name, array in cases.items():
        host = jax.device_put(array, jax.local_devices(backend="cpu")[0])  # as the host build holds them
        seconds = _timed(lambda host=host: jax.device_put(host, device))
        size = host.size * jnp.dtype(host.dtype).itemsize if name != "uint4" else host.size // 2
        print(
            json.dumps({"dtype": name, "seconds": seconds, "GB_per_s": size / seconds / 1e9, "bytes": size}), flush=True
        )
    # uint4 as bytes: the packed bytes go over and the chip reinterprets them
    packed = raw.reshape(-1, 4096)
    unpack = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint4))
    unpack(jax.device_put(packed[:8], device)).block_until_ready()
    seconds = _timed(lambda: unpack(jax.device_put(packed, device)))
    print(json.dumps({"dtype": "uint8 -> uint4 on the chip", "seconds": seconds, "GB_per_s": BYTES / seconds / 1e9}))
    print(json.dumps({"jax": jax.__version__, "device": str(device)}))


if __name__ == "__main__":
    main()
