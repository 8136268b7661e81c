"""What every step program shares: its command line, fetching inputs, committing its output.

A step program is ``python -m loraflow.steps.<stage>`` with::

    --output gs://ROOT/PIPELINE/RUN/STAGE     the prefix it owns
    --input NAME=URI                          repeated; a stage's _MANIFEST.json or a source URI
    --config-json '{...}'                     the resolved stage config
    --fingerprint NAME=F                      repeated; what the cache key was computed from
    --lock-version V --cache-key K            recorded in the manifest

and nothing else of the world, so the local launcher, Vertex AI and GKE run the same argv. The
harness downloads and verifies every input into a scratch directory, calls the stage's function
with local paths, uploads what it wrote and commits the manifest last.

The runner lists the inputs once to compute the cache key, and the step lists them again to fetch
them. With ``--fingerprint`` for every input, the step checks, before it downloads anything, that
each input still has the identity the key was computed from (and that the key is the hash of those
identities, this config and this lock version): an input that changed in between fails the step
(``InputChangedError``), so nothing is ever committed or cached under a key it was not computed
from. Each download is verified against the listing that was checked.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from loraflow.errors import ArtifactError, DataValidationError, LoraflowError
from loraflow.storage import artifacts, faults, gcs
from loraflow.storage.local_paths import safe_join

log = logging.getLogger("loraflow.step")

RESULT_MARKER = "LORAFLOW_RESULT "


@dataclass
class StepContext:
    stage: str
    output_uri: str
    inputs: dict[str, Path]
    input_manifests: dict[str, artifacts.Manifest | None]
    out: Path
    work: Path
    config: dict[str, Any]
    summary: dict[str, Any] = field(default_factory=dict)
    # False in the processes of a multi-host job other than process 0: they upload and commit nothing.
    commits: bool = True

    def progress(self, message: str) -> None:
        print(f"[{self.stage}] {message}", flush=True)


StepFn = Callable[[StepContext], dict[str, Any] | None]


def parser(stage: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m loraflow.steps.{stage}",
        description=f"loraflow step program for the {stage} stage (inputs and output are gs:// URIs).",
    )
    p.add_argument("--output", required=True, help="gs:// prefix this stage owns and commits")
    p.add_argument("--input", action="append", default=[], metavar="NAME=URI", help="an input (repeatable)")
    p.add_argument(
        "--ref", action="append", default=[], metavar="NAME=URI", help="an input that is verified, not downloaded"
    )
    p.add_argument(
        "--fingerprint",
        action="append",
        default=[],
        metavar="NAME=FINGERPRINT",
        help="the identity of input NAME that the cache key was computed from (repeatable); checked before fetching",
    )
    p.add_argument("--config-json", default="{}", help="the resolved stage config, as JSON")
    p.add_argument("--lock-version", default="unversioned", help="lock version of this environment")
    p.add_argument("--cache-key", default="", help="cache key the manifest is committed under")
    return p


def _parse_inputs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, uri = pair.partition("=")
        if not sep or not name or not uri:
            raise LoraflowError(f"--input {pair!r}: write NAME=gs://BUCKET/PATH")
        gcs.split_uri(uri)
        if name in out:
            raise LoraflowError(f"--input {name} given twice")
        out[name] = uri
    return out


class InputChangedError(ArtifactError):
    """A step's input is not what its cache key was computed from (it changed after the lookup)."""


def _parse_fingerprints(pairs: list[str], names: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise LoraflowError(f"--fingerprint {pair!r}: write NAME=FINGERPRINT")
        if name in out:
            raise LoraflowError(f"--fingerprint {name} given twice")
        out[name] = value
    if out and set(out) != names:
        raise LoraflowError(
            f"--fingerprint is given for {sorted(out)} but the inputs are {sorted(names)}; "
            "give one per input (as the runner does) or none"
        )
    return out


def _check_key(fingerprints: dict[str, str], config: dict[str, Any], lock_version: str, key: str) -> None:
    """The cache key must be the hash of the fingerprints the step is about to check its inputs against."""
    if fingerprints and key and artifacts.cache_key(fingerprints, config, lock_version) != key:
        raise InputChangedError(
            f"--cache-key {key} is not the cache key of the given --fingerprint values, --config-json and "
            "--lock-version; run the step with the argv the runner builds (loraflow plan shows its shape)"
        )


def _check_input(name: str, uri: str, actual: str, expected: dict[str, str], key: str) -> None:
    if name in expected and expected[name] != actual:
        raise InputChangedError(
            f"input {name} ({uri}) is not what cache key {key} was computed from: its fingerprint is now "
            f"{actual}, the runner saw {expected[name]}. It changed after the cache lookup; nothing was "
            "fetched or committed. Re-run the stage: its key is computed again from what is there now"
        )


def _upstream_record(manifest: artifacts.Manifest) -> dict[str, str]:
    """How a manifest records an upstream stage it used: its URI, its bytes' fingerprint, and its cache
    key, which is what stands for it in this stage's own cache key (``runner.input_fingerprints``)."""
    record = {"uri": manifest.uri, "fingerprint": manifest.fingerprint}
    if manifest.data.get("cache_key"):
        record["cache_key"] = manifest.data["cache_key"]
    return record


def run_step(stage: str, fn: StepFn, argv: list[str] | None = None) -> int:
    # The task log shows loraflow's progress and the libraries' warnings; their INFO chatter (Orbax,
    # absl, vLLM) only with LORAFLOW_LOG_LEVEL=INFO (or DEBUG).
    level = os.environ.get("LORAFLOW_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("absl", "jax", "orbax", "vllm"):
        logging.getLogger(name).setLevel(level)
    logging.getLogger("loraflow").setLevel(logging.INFO)
    args = parser(stage).parse_args(argv)
    try:
        return _run(stage, fn, args)
    except LoraflowError as exc:
        print(f"[{stage}] ERROR: {exc}", file=sys.stderr, flush=True)
        return 2


def import_permanently(*modules: str) -> float:
    """Import a step's heavy libraries with the cyclic garbage collector off, then freeze every object
    that exists (``gc.freeze``: no later collection walks them again); the collector's state is restored.
    Returns the seconds it took.

    vLLM's import makes about a million objects, JAX + MaxText's 1.3 million: with the collector on,
    it walked them again and again while they loaded (vLLM 5.6-6.0 s against 4.5-4.8 s off; JAX +
    MaxText 7.9-8.9 s against 6.2-6.5 s on 2 cores), and each later full collection took 0.3-0.4 s
    (vLLM runs five while it loads a model). The price: the import's own cyclic garbage, about 13 MiB,
    is never freed. Modules already imported are skipped; with none left, nothing is frozen (a second
    step run in the same process, as in the tests, does not freeze what the first one left)."""
    missing = [name for name in modules if name not in sys.modules]
    if not missing:
        return 0.0
    enabled = gc.isenabled()
    started = time.monotonic()
    gc.disable()
    try:
        for name in missing:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return time.monotonic() - started


def run_and_exit(stage: str, fn: StepFn, leave_at_once: Callable[[], bool] | None = None) -> NoReturn:
    """A step program's ``__main__``: :func:`run_step`, then :func:`exit_process` with its status.

    ``leave_at_once`` (lora_sft: whether this process is a host of a multi-host job) says whether a
    failed process exits without waiting for its threads and ``atexit`` handlers: with a loraflow error
    (status 2) or any other exception (status 1, its traceback printed first), which would otherwise wait
    in JAX's shutdown barrier for hosts that wait for it in a collective. Without it, or when it is false,
    an exception ends the process as Python's own exit does."""

    def at_once() -> bool:
        return leave_at_once is not None and leave_at_once()

    try:
        status = run_step(stage, fn)
    except Exception:
        if not at_once():
            raise
        traceback.print_exc()
        status = 1
    exit_process(status, wait=status == 0 or not at_once())


def exit_process(status: int, wait: bool = True) -> NoReturn:
    """End this process with ``status`` as a normal exit would, minus the interpreter's teardown.

    What anyone outside the process can see still happens, in the interpreter's own order: threads
    that are not daemons are waited for (``threading._shutdown``, which also runs the hooks of
    ``concurrent.futures``), every ``atexit`` handler runs (JAX's distributed shutdown, whose barrier
    the other hosts of a multi-host job wait on; logging's flush; multiprocessing's children;
    temporary directories' finalizers), stdout and stderr are flushed. Skipped: destroying every
    module and object one by one, which the task would wait for after the step has committed:
    about 1.5 s after Great Expectations, 2.5-3.5 s after JAX/MaxText or vLLM on 2 cores
    (docs/benchmarks.md, section 6). The step programs end with it through :func:`run_and_exit`;
    ``run_step`` itself returns to a caller in the same process.

    ``wait=False``: neither the threads nor the ``atexit`` handlers, only the streams flushed: a failed
    process of a multi-host job, whose threads (Orbax's checkpoint saves) and JAX's shutdown barrier wait
    for the other hosts while those wait for it in a collective; it ends as a lost host does, and they stop
    within the heartbeat timeout (loraflow.trainer.distributed)."""
    if wait:
        wait_for_threads = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first
        if wait_for_threads is not None:
            wait_for_threads()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader went away, or the stream was closed
            pass
    os._exit(status)


@dataclass(frozen=True)
class _Invocation:
    """A step's command line, parsed and checked."""

    output: str
    inputs: dict[str, str]  # --input: fetched into the scratch directory
    refs: dict[str, str]  # --ref: only their manifests are read
    config: dict[str, Any]
    expected: dict[str, str]  # --fingerprint: what the cache key was computed from
    lock_version: str
    cache_key: str


def _invocation(args: argparse.Namespace) -> _Invocation:
    output = args.output.rstrip("/")
    gcs.split_uri(output)
    inputs = _parse_inputs(args.input)
    refs = _parse_inputs(args.ref)
    both = sorted(set(inputs) & set(refs))
    if both:
        raise LoraflowError(f"{', '.join(both)} given both as --input and as --ref; give each input once")
    config = json.loads(args.config_json)
    expected = _parse_fingerprints(args.fingerprint, set(inputs) | set(refs))
    _check_key(expected, config, args.lock_version, args.cache_key)
    return _Invocation(output, inputs, refs, config, expected, args.lock_version, args.cache_key)


def _run(stage: str, fn: StepFn, args: argparse.Namespace) -> int:
    call = _invocation(args)
    if _already_committed(stage, call):
        return 0
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix=f"loraflow-{stage}-", dir=os.environ.get("LORAFLOW_SCRATCH")))
    try:
        ctx = StepContext(stage, call.output, {}, {}, root / "out", root / "work", call.config)
        ctx.out.mkdir()
        ctx.work.mkdir()
        fingerprints, listings = _check_inputs(ctx, call)
        _fetch_inputs(ctx, call.inputs, listings, root / "in")
        summary = _call_step(fn, ctx)
        if not ctx.commits:
            ctx.progress(
                "not the committing process of this multi-host job: no output uploaded (process 0 commits them)"
            )
            return 0
        _commit(ctx, call, fingerprints, {**ctx.summary, **summary, "seconds": round(time.monotonic() - started, 2)})
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _already_committed(stage: str, call: _Invocation) -> bool:
    """True when the output already holds this cache key's artifact; another key's artifact is an error."""
    existing = artifacts.read_json(gcs.join(call.output, artifacts.MANIFEST))
    if existing is None:
        return False
    if call.cache_key and existing.get("cache_key") == call.cache_key:
        print(f"[{stage}] {call.output} is already committed with this cache key; nothing to do", flush=True)
        _print_result(artifacts.read_manifest(call.output))
        return True
    raise LoraflowError(
        f"{call.output} already holds a committed artifact with another cache key; "
        "committed artifacts are never overwritten: use a new run id"
    )


def _check_inputs(
    ctx: StepContext, call: _Invocation
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, dict[str, Any]]]]:
    """Every input is looked at and checked against its expected fingerprint before any is fetched.

    Sets ``ctx.input_manifests``; returns what the manifest records of each input and the file
    listings of the inputs that are not artifacts (the fetch verifies against them)."""
    fingerprints: dict[str, dict[str, str]] = {}
    listings: dict[str, dict[str, dict[str, Any]]] = {}
    looked_at = {**call.inputs, **{name: artifacts.manifest_uri(uri) for name, uri in call.refs.items()}}
    for name, uri in looked_at.items():
        if uri.endswith("/" + artifacts.MANIFEST):
            manifest = artifacts.read_manifest(uri)
            _check_input(name, uri, artifacts.input_identity(manifest), call.expected, call.cache_key)
            ctx.input_manifests[name] = manifest
            fingerprints[name] = _upstream_record(manifest)
        else:
            listings[name] = artifacts.source_files(uri)
            _check_input(name, uri, artifacts.fingerprint(listings[name]), call.expected, call.cache_key)
            ctx.input_manifests[name] = None
            fingerprints[name] = {"uri": uri, "fingerprint": artifacts.fingerprint(listings[name])}
    return fingerprints, listings


def _fetch_inputs(
    ctx: StepContext, inputs: dict[str, str], listings: dict[str, dict[str, dict[str, Any]]], into: Path
) -> None:
    """Download each --input into ``into/NAME``, verified, and point ``ctx.inputs`` at it."""
    for name, uri in inputs.items():
        dest = safe_join(into, name, what=f"--input {name}={uri}")
        input_manifest = ctx.input_manifests[name]
        if input_manifest is not None:
            artifacts.fetch(input_manifest, dest)
        else:
            artifacts.fetch_source(uri, dest, listings[name])
        ctx.inputs[name] = dest
        ctx.progress(f"input {name}: {uri} fetched and verified")


def _call_step(fn: StepFn, ctx: StepContext) -> dict[str, Any]:
    """The stage's own work; a rejected dataset's evidence is uploaded beside the output, never committed."""
    try:
        return fn(ctx) or {}
    except DataValidationError:
        # Keep the evidence (e.g. the data-quality report) for people, but never commit it:
        # without a manifest nothing downstream can use it.
        rejected = gcs.join(ctx.output_uri, "_rejected")
        artifacts.upload_tree(ctx.out, rejected)
        ctx.progress(f"evidence of the rejection uploaded to {rejected}/ (not an artifact)")
        raise


def _commit(
    ctx: StepContext, call: _Invocation, fingerprints: dict[str, dict[str, str]], summary: dict[str, Any]
) -> None:
    """Upload what the step wrote, then commit its manifest (last: the artifact exists from then on)."""
    files = artifacts.upload_tree(ctx.out, call.output)
    faults.point("before_manifest")
    manifest = artifacts.commit(
        call.output,
        files,
        stage=ctx.stage,
        inputs=fingerprints,
        config=call.config,
        lock_version=call.lock_version,
        cache_key=call.cache_key,
        summary=summary,
    )
    ctx.progress(f"committed {len(files)} file(s) at {manifest.uri}")
    _print_result(manifest)


def _print_result(manifest: artifacts.Manifest) -> None:
    print(RESULT_MARKER + json.dumps({"manifest": manifest.uri, "summary": manifest.summary}), flush=True)
