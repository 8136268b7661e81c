"""Which code runs ``compute.<stage>.launcher``: the one table from launcher name to launcher class.

A new launcher: its config class in ``loraflow/spec/compute.py``, then its module here beside the
others (a ``Launcher`` subclass naming that config, its trigger and plan request,
``loraflow/launchers/base.py``) and one entry below (docs/architecture.md, "Adding a launcher").
"""

from __future__ import annotations

from loraflow.errors import LoraflowError
from loraflow.launchers.base import Launcher
from loraflow.launchers.gke import GkeLauncher
from loraflow.launchers.identity import JobIdentity
from loraflow.launchers.local import LocalLauncher
from loraflow.launchers.vertex import VertexLauncher
from loraflow.spec.compute import AnyCompute

LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (LocalLauncher, VertexLauncher, GkeLauncher)}


def launcher_class(name: str, stage: str) -> type[Launcher]:
    """The class of the launcher ``name``; a name this version cannot start is refused with the key to fix."""
    cls = LAUNCHERS.get(name)
    if cls is None:
        raise LoraflowError(
            f"stage {stage} asks for the {name!r} launcher, which this loraflow version cannot start; "
            f"set compute.{stage}.launcher to {', '.join(list(LAUNCHERS)[:-1])} or {list(LAUNCHERS)[-1]}"
        )
    return cls


def launcher_for(compute: AnyCompute, identity: JobIdentity, output_prefix: str) -> Launcher:
    """The launcher that runs the stage ``identity.stage`` as ``compute`` says, committing under ``output_prefix``."""
    return launcher_class(compute.launcher, identity.stage)(compute, identity, output_prefix)
