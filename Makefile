# loraflow: every command a user or CI needs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENVS   := .venvs
# uv resolves and installs in seconds; bootstrap it into its own venv if it is not on PATH.
UV      ?= $(shell command -v uv 2>/dev/null || echo $(VENVS)/.uv/bin/uv)
# Interpreters: the image ships them under pyenv; any python3.12 / python3.11 on PATH works too.
PY312   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12 2>/dev/null))
PY311   ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.11*/bin/python3.11) $(shell command -v python3.11 2>/dev/null))
# The CPU torch wheel for the serving env lies on disk here; elsewhere point TORCH_WHEELS at yours.
TORCH_WHEELS ?= /opt/wheels
PIP_CONSTRAINTS ?= $(wildcard /etc/xdg/pip/constraints.txt)
# The CeleryExecutor's broker (loraflow/dev/local_celery.py: the distributed e2e, `make demo CELERY_WORKERS=2`):
# Debian's redis-server, installed when missing.
REDIS_SERVER ?= /usr/bin/redis-server
# `make demo` / `make ui` with CELERY_WORKERS=N: Airflow distributed over N Celery workers (on PostgreSQL).
CELERY_WORKERS ?=
DEMO_ARGS := $(if $(CELERY_WORKERS),--celery-workers $(CELERY_WORKERS))
export UV_PYTHON_DOWNLOADS := never

CONTROL := $(VENVS)/control/bin/python
TRAINER := $(VENVS)/trainer/bin/python
SERVING := $(VENVS)/serving/bin/python
NO_TORCH_EXTRAS := --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec

.PHONY: help envs lock demo ui test lint typecheck test-control test-trainer test-serving test-e2e clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

# The native merge kernel (loraflow/lora/native): a C compiler builds it; Debian's gcc is installed if there is none.
NATIVE := loraflow/lora/native/libloraflow_merge.so

$(NATIVE): loraflow/lora/native/merge_rows.c loraflow/lora/native/build.sh
	@command -v $${CC:-cc} >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev))
	loraflow/lora/native/build.sh

$(VENVS)/.uv/bin/uv:
	python3 -m venv $(VENVS)/.uv && $(VENVS)/.uv/bin/pip install -q uv

envs: $(VENVS)/control/.synced $(VENVS)/trainer/.synced $(VENVS)/serving/.synced $(NATIVE)  ## create the three environments from their lock files, build the merge kernel

# Bytecode: uv installs none, and where PYTHONDONTWRITEBYTECODE is set (as on the machines make test runs on)
# every process compiled each module it imported from source, every time (importing MaxText took 30 CPU s
# against 10, vLLM 14 against 5, Airflow 6 against 3), and the tests start dozens of step, host and Airflow
# processes. So every command make runs runs with it unset: the first process to import a module writes its
# .pyc into the environment, and every later one (pytest, the step programs, Airflow's processes, the hosts of a
# multi-host job: all started under make) reads it. That is cheaper than compiling each environment whole at
# set-up (uv's --compile-bytecode: 231 CPU s for the three, ~87,000 files, of which the serving tier imports 26 %;
# docs/architecture.md). Run pytest outside make with PYTHONDONTWRITEBYTECODE unset for the same.
unexport PYTHONDONTWRITEBYTECODE

$(VENVS)/control/.synced: envs/control.lock pyproject.toml | $(UV)
	$(UV) venv -q --allow-existing $(VENVS)/control --python $(PY312)
	$(UV) pip sync -q -p $(VENVS)/control envs/control.lock
	$(UV) pip install -q -p $(VENVS)/control --no-deps -e .
	touch $@

$(VENVS)/trainer/.synced: envs/trainer.lock | $(UV)
	$(UV) venv -q --allow-existing $(VENVS)/trainer --python $(PY312)
	$(UV) pip sync -q -p $(VENVS)/trainer envs/trainer.lock
	touch $@

$(VENVS)/serving/.synced: envs/serving.lock | $(UV)
	$(UV) venv -q --allow-existing $(VENVS)/serving --python $(PY311)
	$(UV) pip sync -q -p $(VENVS)/serving --find-links $(TORCH_WHEELS) envs/serving.lock
	touch $@

# The accelerator serving builds (docker/serving.Dockerfile SERVING_BUILD=tpu|cuda) are only ever installed
# in an image: resolved for its platform (Linux x86-64, Debian's glibc), from the package registry alone.
IMAGE_PLATFORM := x86_64-manylinux_2_36

lock: | $(UV)  ## re-resolve every lock file from envs/*.in (the three environments, the TPU and CUDA serving builds)
	cd envs && $(abspath $(UV)) pip compile -q control.in -o control.lock --python-version 3.12
	cd envs && $(abspath $(UV)) pip compile -q trainer.in -o trainer.lock --python-version 3.12 --override trainer.overrides
	cd envs && $(abspath $(UV)) pip compile -q serving.in -o serving.lock --python-version 3.11 --find-links $(TORCH_WHEELS) \
		$(if $(PIP_CONSTRAINTS),--constraint $(PIP_CONSTRAINTS)) $(NO_TORCH_EXTRAS)
	cd envs && $(abspath $(UV)) pip compile -q serving-tpu.in -o serving-tpu.lock --python-version 3.12 --python-platform $(IMAGE_PLATFORM)
	cd envs && $(abspath $(UV)) pip compile -q serving-cuda.in -o serving-cuda.lock --python-version 3.12 --python-platform $(IMAGE_PLATFORM)

demo: envs $(if $(CELERY_WORKERS),$(REDIS_SERVER))  ## run the tiny pipeline end to end on a local Airflow + GCS emulator, print the verdict, stop
	$(CONTROL) -m loraflow.dev.demo run $(DEMO_ARGS)

ui: envs $(if $(CELERY_WORKERS),$(REDIS_SERVER))  ## start Airflow + the GCS emulator on 127.0.0.1 and keep them up (credentials and the TensorBoard command printed)
	$(CONTROL) -m loraflow.dev.demo ui $(DEMO_ARGS)

lint: envs  ## ruff
	$(VENVS)/control/bin/ruff check .
	$(VENVS)/control/bin/ruff format --check .

typecheck: envs  ## mypy over the core, operators and dags
	$(VENVS)/control/bin/mypy

test-control: envs
	$(CONTROL) -m pytest tests/control -q

# The trainer tier's 20 slowest steps are listed at its end (CI's log shows where its time goes).
test-trainer: envs
	$(TRAINER) -m pytest tests/trainer -q --durations=20

test-serving: envs
	$(SERVING) -m pytest tests/serving -q

# The browser test drives the system Chromium (Debian's package; /usr/bin/chromium's wrapper fails, the binary works).
CHROMIUM ?= /usr/lib/chromium/chromium

$(CHROMIUM):
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

$(REDIS_SERVER):
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server)

# CI runs every end-to-end module (3-10 minutes each on 2 cores; the tiny pipeline, hand-off, Vertex and
# browser modules share one Airflow, the Celery and load modules a distributed one, the others start
# their own: tests/e2e/conftest.py): the tiny pipeline, every stage killed once and finished by Airflow's
# retries, the data-team hand-off, lora_sft on the Vertex AI stand-in under a deferring Airflow, the
# browser test, and on Celery workers with a Redis broker and PostgreSQL (installed from Debian packages
# when missing) eight concurrent runs and the tiny pipeline with one worker lost mid-stage. The 15 slowest steps (set-up included) are
# listed at the end: CI's budget is 90 minutes, and e2e is most of it.
E2E := $(wildcard tests/e2e/test_*.py)

test-e2e: envs $(CHROMIUM) $(REDIS_SERVER)
	LORAFLOW_CHROMIUM=$(CHROMIUM) $(CONTROL) -m pytest $(E2E) -q -s --durations=15 $(PYTEST_ARGS)

# make test runs its checks in two lanes side by side (loraflow/dev/lanes.py): the end-to-end tier in one,
# lint, types and the other tiers one after another in the other; each tier mostly keeps one of 2 cores busy
# (walls in docs/architecture.md). The first lane streams; the other's output is printed whole per target.
# make test TEST_LANES=1 runs every target in one lane, one after another.
TEST_LANES ?= 2

# The lanes runner is standard library only and runs on the base Python: the line names $(MAKE), so make -n
# runs it too (its targets dry-run), before any environment exists.
test: envs $(CHROMIUM) $(REDIS_SERVER)  ## set up and run every check and test (what CI runs; TEST_LANES=1: one after another)
	$(PY312) -m loraflow.dev.lanes --make "$(MAKE)" $(if $(filter 1,$(TEST_LANES)),--one-lane) \
		test-e2e "lint typecheck test-control test-serving test-trainer"

clean:  ## remove the demo's state (Airflow DB, emulator data); keeps the environments
	rm -rf .demo

# mutmut mutates a scratch copy under .mutate/ (never the tree) and runs only each module's fast tests;
# it is installed on top of the control and trainer envs, their locked versions kept. MUTATE=spec gate_rule: some.
.PHONY: mutate
mutate: envs  ## mutation testing of the modules where a silent bug costs most (over 20 min on 2 cores, MUTATE= for some targets; not in CI; docs/mutation.md)
	$(UV) pip install -q -p $(VENVS)/control -c envs/control.lock -r envs/mutate.txt
	$(UV) pip install -q -p $(VENVS)/trainer -c envs/trainer.lock -r envs/mutate.txt
	$(CONTROL) tools/mutate.py $(MUTATE)

.PHONY: bench
bench: envs  ## benchmarks side by side -> docs/benchmarks.md, bench/results/ (~35 min on 2 cores; BENCH_QUICK=1 for a smoke run)
	$(CONTROL) bench/run_all.py

# The training stage on a TPU chip (bench/tpu/README.md): what travels to the device machine is made here.
.PHONY: tpu-prepare
tpu-prepare: $(VENVS)/trainer/.synced  ## make what bench/tpu/check.py needs on a TPU machine: .whl-tpu/ (wheels) and .tpu-inputs/ (the tiny base)
	bash bench/tpu/wheels.sh
	$(TRAINER) -c "from pathlib import Path; from loraflow.dev import tinymodel; \
		tinymodel.create(Path('.tpu-inputs/tiny'), [Path('pipelines/data/parity/train.jsonl')])"

# The images (docs/production.md, "Building the images here"), built with buildah (Debian's package,
# installed when missing) and smoke-run on the tiny model: before every release, not in CI. Where no
# container registry answers, their bases are made from Debian's packages (mmdebstrap) and the
# interpreters above (docker/local-base.sh); IMAGE_BASES=public pulls python:3.1x-slim-bookworm instead.
BUILDAH ?= /usr/bin/buildah
MMDEBSTRAP ?= /usr/bin/mmdebstrap
IMAGE_BASES ?= local

$(BUILDAH) $(MMDEBSTRAP):
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(notdir $@) || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(notdir $@))

.PHONY: images
images: $(VENVS)/control/.synced $(VENVS)/trainer/.synced $(BUILDAH) $(if $(filter local,$(IMAGE_BASES)),$(MMDEBSTRAP))  ## build the control, trainer and CPU serving images (buildah) and smoke-run each on the tiny model (25-35 min on 2 cores; run before every release, not in CI)
	$(CONTROL) tools/images.py --bases $(IMAGE_BASES) --python3.12 "$(PY312)" --python3.11 "$(PY311)" --torch-wheels $(TORCH_WHEELS)
