"""What vLLM's TPU backend needs on the TPU device machine and nowhere else (bench/tpu/README.md, "Serving").

That machine opens no TCP or UDP socket, not even on loopback, and reads no cloud metadata; a TPU host in
production does both, so none of this belongs in loraflow. :func:`without_sockets` is called before
vLLM is imported:

- ``torch.distributed``'s gloo backend (vLLM's one-rank CPU process group; it listens on a socket)
  becomes torch's built-in ``fake`` backend, which holds one rank and talks to nobody. The TPU
  worker's rendezvous is a ``file://`` store already.
- vLLM's free-port search (it binds a socket to find one) returns made-up port numbers: nothing ever
  listens on them with one in-process engine core.
- The address and TPU facts vLLM and tpu-inference would look up (``VLLM_HOST_IP``: a UDP probe; the
  TPU's type, name and worker id: the GCE metadata server) are set.

:func:`without_torchvision` is for vLLM's torch model path (``MODEL_IMPL_TYPE=vllm``, the one LoRA
takes): it imports transformers' Qwen2-VL image processor, which imports torchvision at module level,
and no torchvision wheel imports beside torch 2.13.0+cpu there. Every ``torchvision`` module becomes
an empty one whose names are placeholders that raise when used.

:func:`fix_torchax` runs once at install (``install_serve.sh``): torchax 0.0.11 names aten overloads
that torch 2.13 dropped (the named-tensor ``Dimname`` ones) in its op tables and fails at import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

#: The device machine's facts, as a GCE TPU VM's metadata would give them.
DEVICE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process (loraflow sets it too)
    "VLLM_HOST_IP": "127.0.0.1",
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_NAME": "local",
    "TPU_WORKER_ID": "0",
}


def without_sockets() -> None:
    """Make vLLM's one-chip, in-process engine start where no socket opens (see the module's docstring)."""
    for key, value in DEVICE_ENV.items():
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    dist.init_process_group = _fake_instead_of_gloo(dist.init_process_group, position=0)
    dist.new_group = _fake_instead_of_gloo(dist.new_group, position=2)

    import vllm.utils.network_utils as network
    import vllm.v1.executor.uniproc_executor as uniproc

    ports = itertools.count(29500)

    def made_up_port(*args: Any, **kwargs: Any) -> int:
        return next(ports)

    def made_up_ports(count: int = 5, *args: Any, **kwargs: Any) -> list[int]:
        return [next(ports) for _ in range(count)]

    network.get_open_port = network._get_open_port = uniproc.get_open_port = made_up_port
    network.get_open_ports_list = made_up_ports


def _fake_instead_of_gloo(fn: Any, position: int) -> Any:
    """``fn`` with its ``backend`` argument (keyword, or positional at ``position``) gloo -> fake."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if len(args) > position:
            if args[position] in (None, "gloo"):
                args = (*args[:position], "fake", *args[position + 1 :])
        elif kwargs.get("backend") in (None, "gloo"):
            kwargs["backend"] = "fake"
        return fn(*args, **kwargs)

    return wrapped


# --------------------------------------------------------------------------- torchvision stand-in


class _Placeholder(type):
    """A torchvision name: any attribute is another placeholder; calling one raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"torchvision is not installed on this machine ({cls.__name__} was called)")


class _EmptyModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Placeholder(name, (), {})
        setattr(self, name, value)
        return value


class _TorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != "torchvision":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _EmptyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0.0+absent"  # type: ignore[attr-defined]
        if module.__name__ == "torchvision.transforms":  # an enum transformers reads members of
            import enum

            module.InterpolationMode = enum.Enum(  # type: ignore[attr-defined]
                "InterpolationMode",
                {
                    n.upper().replace("-", "_"): n
                    for n in ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")
                },
            )


def without_torchvision() -> bool:
    """Empty ``torchvision`` modules where none is installed; True when they were put in place."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _TorchvisionFinder())
    return True


# --------------------------------------------------------------------------- torchax on torch 2.13

_OVERLOAD_LINE = re.compile(r"^\s*torch\.ops\.aten\.(\w+)\.(\w+)\s*[,:]")


def fix_torchax(site: Path) -> list[str]:
    """Drop the lines of torchax's op tables that name an aten overload this torch lacks; what was dropped."""
    import torch

    def missing(op: str, overload: str) -> bool:
        try:
            getattr(getattr(torch.ops.aten, op), overload)
        except (AttributeError, RuntimeError):
            return True
        return False

    dropped = []
    for path in sorted((site / "torchax").rglob("*.py")):
        lines = path.read_text().split("\n")
        kept = [line for line in lines if not ((m := _OVERLOAD_LINE.match(line)) and missing(*m.groups()))]
        if len(kept) != len(lines):
            path.write_text("\n".join(kept))
            dropped.append(f"{path.relative_to(site)}: {len(lines) - len(kept)} line(s)")
    return dropped


if __name__ == "__main__":  # install_serve.sh: python3 _serve_device.py fix-torchax SITE
    if sys.argv[1:2] == ["fix-torchax"]:
        for line in fix_torchax(Path(sys.argv[2])):
            print(f"install_serve.sh: torchax fixed for torch 2.13: {line}")
