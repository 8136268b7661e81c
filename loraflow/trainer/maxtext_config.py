"""MaxText's config, built without turning on XLA's HLO dumps for the rest of the process.

MaxText's config validation (``maxtext/configs/types.py``, ``validate_and_set_hlo_dump_defaults``) runs
whatever ``dump_hlo`` says, and where ``XLA_FLAGS`` is unset it sets it to
``--xla_dump_to=/tmp/xla_dump/ --xla_dump_large_constants --xla_dump_hlo_module_re=jit_train_step``: from
then on XLA writes every train step it compiles, as HLO text with its large constants, into the host's
shared ``/tmp``, and nothing deletes it (a CPU test run left 232 files there). XLA reads the variable when
its first backend starts, which ``pyconfig.initialize`` itself may do. :func:`hlo_dumps_off` gives
``XLA_FLAGS`` a flag that changes nothing for the call (:data:`NEUTRAL`), so MaxText leaves it alone, and
puts it back as it was. A value a deployer set (a spec's ``env``, within its allow-list) is kept as it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# XLA's host platform has one device unless told otherwise: the flag's default, so setting it changes
# nothing (and it is on loraflow's allow-list of XLA flags, loraflow.spec.env_rules)
NEUTRAL = "--xla_force_host_platform_device_count=1"


@contextlib.contextmanager
def hlo_dumps_off() -> Iterator[None]:
    """While open, ``XLA_FLAGS`` is :data:`NEUTRAL` where it was unset or empty; afterwards as it was."""
    before = os.environ.get("XLA_FLAGS")
    if before:
        yield
        return
    os.environ["XLA_FLAGS"] = NEUTRAL
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = before


def sft_config(argv: list[str]) -> Any:
    """MaxText's (pydantic) config of ``argv``, under :func:`hlo_dumps_off`."""
    from maxtext.configs import pyconfig

    with hlo_dumps_off():
        return pyconfig.initialize_pydantic(argv)
