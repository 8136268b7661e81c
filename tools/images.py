"""`make images`: build the control, trainer and CPU serving images from this repository with buildah,
smoke-run each, and print their sizes and build times (docs/production.md, "Building the images here").
Run it before every release; CI does not (no container builder there, and not the time).

Daemonless, and no container registry needed: buildah builds and runs with ``--isolation chroot``
(an OCI runtime needs cgroups this kind of machine may not offer) and host networking (the package
registries are reached as from the host; the GCS emulator the smoke runs use listens on 127.0.0.1).
With ``--bases local`` the Dockerfiles' FROM is a base made here from Debian's packages and this
machine's CPython (docker/local-base.sh); ``--bases public`` pulls python:3.1x-slim-bookworm.

The smoke runs are the pipeline's own stages on the tiny model: the runner resolves inputs, cache keys
and fingerprints as for any run, and the step program runs inside the image with the argv every
launcher uses (Vertex AI's container args are the same):

- control: parses dags/ (one DAG per spec, no import error), ``loraflow validate``, validate_data
- trainer: convert_checkpoint -> lora_sft -> merge_adapter
- serving (CPU build): evaluate_tuned on the merged model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loraflow.errors import LoraflowError  # noqa: E402
from loraflow.launchers.local import step_environment  # noqa: E402
from loraflow.pipeline import runner  # noqa: E402
from loraflow.pipeline.runner import StageResult  # noqa: E402
from loraflow.spec.schema import PipelineSpec  # noqa: E402

TAG = "localhost/loraflow"
LOCAL_BASES = {"3.12": "localhost/loraflow-base:3.12", "3.11": "localhost/loraflow-base:3.11"}
PUBLIC_BASES = {"3.12": "python:3.12-slim-bookworm", "3.11": "python:3.11-slim-bookworm"}
SMOKE_SPEC = REPO / "pipelines" / "tiny-llama-lora.yaml"
SMOKE_STEPS = 30  # lora_sft's optimizer steps: enough to write a checkpoint and an adapter, short on 2 cores
# (image, stage) in the pipeline's order: each stage's inputs are the commits of the ones before.
SMOKE_STAGES = (
    ("control", "validate_data"),
    ("trainer", "convert_checkpoint"),
    ("trainer", "lora_sft"),
    ("trainer", "merge_adapter"),
    ("serving", "evaluate_tuned"),
)
RESULTS = REPO / "bench" / "results" / "images.json"
# The step's environment minus what names this machine: the image sets its own PATH and PYTHONPATH.
HOST_ONLY = frozenset(
    {"PATH", "HOME", "PYTHONPATH", "TMPDIR", "LORAFLOW_ENVS_DIR", "LORAFLOW_SCRATCH", "JAX_COMPILATION_CACHE_DIR"}
)
# One DAG per spec and the registry's DAG, with no import error: the DAG processor's view inside the image.
DAG_PARSE = """
import json, pathlib
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder="/opt/airflow/dags")
print(json.dumps({"dags": sorted(bag.dag_ids), "errors": {k: str(v)[-300:] for k, v in bag.import_errors.items()}}))
"""


@dataclass(frozen=True)
class Image:
    name: str
    dockerfile: str
    build_args: Mapping[str, str]

    @property
    def ref(self) -> str:
        return f"{TAG}/{self.name}:dev"


IMAGES = (
    Image("control", "docker/control.Dockerfile", {}),
    Image("trainer", "docker/trainer.Dockerfile", {}),
    Image("serving", "docker/serving.Dockerfile", {"SERVING_BUILD": "cpu"}),
)


def say(line: str) -> None:
    print(f"[images] {line}", flush=True)


def buildah(*args: str, capture: bool = False) -> str:
    done = subprocess.run(["buildah", *args], cwd=REPO, check=True, text=True, capture_output=capture)
    return done.stdout if capture else ""


def image_exists(ref: str) -> bool:
    found = subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True)
    return found.returncode == 0


def image_bytes(ref: str) -> int:
    """The image's size unpacked: the sum of its layers (`docker images` shows the same)."""
    inspected = json.loads(buildah("inspect", "--type", "image", ref, capture=True))
    return sum(layer["size"] for layer in json.loads(inspected["Manifest"])["layers"])


def ensure_local_base(version: str, python: str) -> None:
    ref = LOCAL_BASES[version]
    if image_exists(ref):
        return
    if not python:
        raise LoraflowError(
            f"no Python {version} to make {ref} from; set PY{version.replace('.', '')}=/path/to/python{version}"
        )
    say(f"making {ref} from Debian's packages and {python}")
    subprocess.run([str(REPO / "docker" / "local-base.sh"), python, ref], check=True)


def torch_wheel(lock: Path, wheels: Path, dest: Path) -> Path:
    """The CPU torch wheel ``lock`` pins, linked (or copied) from ``wheels`` into the build context's ``dest``."""
    pinned = re.search(r"^torch==(\S+)$", lock.read_text(), re.MULTILINE)
    if pinned is None:
        raise LoraflowError(f"{lock} pins no torch; run `make lock`")
    name = f"torch-{pinned.group(1)}-cp311-cp311-manylinux"
    found = sorted(wheels.glob(f"{name}*.whl"))
    if not found:
        raise LoraflowError(f"no {name}*.whl in {wheels}: point TORCH_WHEELS at the folder holding the CPU torch wheel")
    target = dest / found[-1].name
    if not target.exists():
        try:
            os.link(found[-1], target)
        except OSError:
            target.write_bytes(found[-1].read_bytes())
    return target


def build_argv(image: Image, bases: Mapping[str, str]) -> list[str]:
    args = {"PYTHON312_IMAGE": bases["3.12"], "PYTHON311_IMAGE": bases["3.11"], **image.build_args}
    argv = ["bud", "--isolation", "chroot", "--network", "host", "-f", image.dockerfile, "-t", image.ref]
    for key, value in args.items():
        argv.append(f"--build-arg={key}={value}")
    return [*argv, "."]


def image_id(ref: str) -> str | None:
    if not image_exists(ref):
        return None
    return buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", ref, capture=True).strip()


def build(image: Image, bases: Mapping[str, str]) -> float:
    """Build ``image`` (its seconds); the image it replaces under its tag is removed, not left untagged."""
    say(f"building {image.ref} from {image.dockerfile}")
    replaced = image_id(image.ref)
    start = time.monotonic()
    buildah(*build_argv(image, bases))
    seconds = time.monotonic() - start
    if replaced not in (None, image_id(image.ref)):
        subprocess.run(["buildah", "rmi", replaced], capture_output=True)  # still used by a container: kept
    return seconds


def container_env(step_env: Mapping[str, str]) -> dict[str, str]:
    """What a step program gets in the image: the launcher's step environment less this machine's paths."""
    return {k: v for k, v in step_env.items() if k not in HOST_ONLY}


def run_argv(container: str, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    flags = [f"--env={k}={v}" for k, v in sorted(env.items())]
    return ["buildah", "run", "--isolation", "chroot", "--network", "host", *flags, container, "--", *argv]


@contextmanager
def container(image: Image) -> Iterator[str]:
    """A fresh container of ``image``, removed afterwards (`docker run --rm`)."""
    name = buildah("from", "--pull-never", "--quiet", image.ref, capture=True).strip()
    try:
        yield name
    finally:
        buildah("rm", name, capture=True)


def run_in(image: Image, argv: Sequence[str], env: Mapping[str, str] = {}, capture: bool = False) -> str:
    with container(image) as name:
        done = subprocess.run(run_argv(name, argv, env), text=True, capture_output=capture)
    if done.returncode != 0:
        detail = (done.stderr or "")[-2000:] if capture else ""
        raise LoraflowError(f"{' '.join(argv[:4])} in {image.ref} exited {done.returncode}{detail and ': ' + detail}")
    return done.stdout if capture else ""


def run_stage_in(image: Image, spec: PipelineSpec, stage: str, run_id: str, upstream: dict[str, str]) -> StageResult:
    """One stage of ``spec`` run by the runner with its step program inside ``image``."""
    prepared = runner.prepare_stage(spec, stage, run_id, upstream, say)
    if isinstance(prepared, StageResult):
        raise LoraflowError(f"{stage} was a cache hit; the smoke run needs an empty bucket")
    run_in(image, prepared.argv("python"), container_env(step_environment()))
    result = runner.finish_stage(spec, stage, prepared.prefix, prepared.cache_key)
    upstream[stage] = prepared.prefix
    return result


def smoke(images: Mapping[str, Image], work: Path) -> dict[str, float]:
    """The smoke runs against a GCS emulator on 127.0.0.1; the wall seconds of each."""
    from loraflow.dev import demo, local_gcs
    from loraflow.spec.schema import load_spec, with_overrides

    walls: dict[str, float] = {}
    emulator = local_gcs.start("loraflow-demo")
    os.environ.update(emulator.env())
    try:
        demo.prepare(SMOKE_SPEC, work)
        spec = with_overrides(load_spec(SMOKE_SPEC), {"training.steps": SMOKE_STEPS}, "make images")
        control = images["control"]

        start = time.monotonic()
        parsed = json.loads(
            run_in(
                control, ["python", "-c", DAG_PARSE], {"AIRFLOW__CORE__LOAD_EXAMPLES": "False"}, capture=True
            ).splitlines()[-1]
        )
        specs = {load_spec(p).name for p in sorted((REPO / "pipelines").glob("*.yaml"))}
        if parsed["errors"] or not specs <= set(parsed["dags"]):
            raise LoraflowError(f"the control image's DAG parse: {parsed}")
        say(f"control: dags/ parsed, {len(parsed['dags'])} DAGs, no import error")
        run_in(control, ["loraflow", "validate", "/opt/airflow/pipelines"])
        walls["control: parse dags/, loraflow validate"] = time.monotonic() - start

        upstream: dict[str, str] = {}
        run_id = f"images-{int(time.time())}"
        for image, stage in SMOKE_STAGES:
            start = time.monotonic()
            result = run_stage_in(images[image], spec, stage, run_id, upstream)
            walls[f"{image}: {stage}"] = time.monotonic() - start
            say(f"{image}: {stage} committed {result.manifest} in {walls[f'{image}: {stage}']:.0f} s: {result.summary}")
    finally:
        emulator.stop()
    return walls


def built_images(names: Sequence[str], bases: Mapping[str, str], previous: Mapping[str, dict]) -> dict[str, dict]:
    """Build the images ``names``; the others must be built already (their figures are ``previous``'s)."""
    rows = {}
    for image in IMAGES:
        if image.name in names:
            load = os.getloadavg()[0]
            seconds = build(image, bases)
            rows[image.name] = {"ref": image.ref, "build_s": round(seconds), "load_at_start": round(load, 1)}
        elif image_exists(image.ref):
            rows[image.name] = dict(previous.get(image.name, {"ref": image.ref}))
        else:
            raise LoraflowError(f"{image.ref} is not built; add {image.name} to --build")
        rows[image.name]["bytes"] = image_bytes(image.ref)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--bases", choices=["local", "public"], default="local")
    p.add_argument("--python3.12", dest="py312", default="", help="the interpreter a local 3.12 base is made from")
    p.add_argument("--python3.11", dest="py311", default="", help="the interpreter a local 3.11 base is made from")
    p.add_argument("--torch-wheels", type=Path, default=Path("/opt/wheels"))
    names = [image.name for image in IMAGES]
    p.add_argument(
        "--build", default=",".join(names), help="the images to build, comma-separated; the others must be built"
    )
    p.add_argument("--no-smoke", action="store_true", help="build only")
    args = p.parse_args(argv)
    chosen = [name for name in args.build.split(",") if name]
    if unknown := sorted(set(chosen) - set(names)):
        raise LoraflowError(f"--build {args.build}: no image {', '.join(unknown)}; the images are {', '.join(names)}")

    if args.bases == "local":
        ensure_local_base("3.12", args.py312)
        ensure_local_base("3.11", args.py311)
    bases = LOCAL_BASES if args.bases == "local" else PUBLIC_BASES
    torch_wheel(REPO / "envs" / "serving.lock", args.torch_wheels, REPO / "docker" / "wheels")
    previous = json.loads(RESULTS.read_text()).get("images", {}) if RESULTS.exists() else {}
    rows = built_images(chosen, bases, previous)
    for row in rows.values():
        say(f"{row['ref']}: built in {row.get('build_s', '?')} s, {row['bytes'] / 1e9:.2f} GB")
    result: dict[str, object] = {"bases": bases, "images": rows, "smoke_s": "not run"}
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")  # the build figures, even if a smoke run fails
    if not args.no_smoke:
        with tempfile.TemporaryDirectory(prefix="loraflow-images-") as work:
            walls = smoke({image.name: image for image in IMAGES}, Path(work))
        result["smoke_s"] = {k: round(v) for k, v in walls.items()}
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    say(f"figures in {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (LoraflowError, subprocess.CalledProcessError) as exc:
        print(f"make images: {exc}", file=sys.stderr)
        sys.exit(1)
