"""Shared helpers for the benchmarks: run a child in one of the venvs, measure wall time and peak RSS.

Runs under any of the three interpreters (stdlib only). Timings are wall-clock; peak RSS is the
child's own ru_maxrss from wait4 (its grandchildren are not counted, and none of the measured
commands spawn any unless said so).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
VENVS = REPO / ".venvs"
PY = {name: str(VENVS / name / "bin" / "python") for name in ("control", "trainer", "serving")}
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")
# A quick smoke run never overwrites the real results or docs/benchmarks.md.
RESULTS = BENCH / "results" / "quick" if QUICK else BENCH / "results"
WORK = Path(os.environ.get("BENCH_WORK", "/tmp/loraflow-bench"))
LOAD_AT_IMPORT = os.getloadavg()  # a comparison's driver imports this first: its load average at start


def env(**extra: str) -> dict[str, str]:
    """A child's environment. Compiled bytecode is kept (under WORK/pycache) whatever the caller's
    PYTHONDONTWRITEBYTECODE says: a deployed Airflow or step image imports compiled modules, it does
    not compile every module on every start."""
    e = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"),
        "PYTHONPYCACHEPREFIX": str(WORK / "pycache"),
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    e.update(extra)
    return e


def run(
    argv: list[str],
    *,
    extra_env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 1800,
    quiet: bool = True,
) -> dict[str, Any]:
    """Run argv; return wall seconds, peak RSS (MiB) of the child, return code, the last stdout line as JSON if any."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=cwd or REPO,
        env=env(**(extra_env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if quiet else None,
        text=True,
    )
    out, err = proc.communicate(timeout=timeout)  # communicate reaps; use wait4 data from rusage below
    wall = time.perf_counter() - t0
    # Popen.communicate waited already; ru_maxrss of this child comes from the result line the
    # child prints itself (see child_rss) or from /usr/bin/time when wrapped.
    result: dict[str, Any] = {"wall_s": wall, "rc": proc.returncode}
    for line in reversed(out.strip().splitlines()):
        if line.startswith("BENCH_JSON "):
            result.update(json.loads(line[len("BENCH_JSON ") :]))
            break
    if proc.returncode != 0:
        result["stderr_tail"] = (err or "")[-3000:]
        result["stdout_tail"] = out[-2000:]
    return result


def run_timed(argv: list[str], **kw: Any) -> dict[str, Any]:
    """:func:`run` under /usr/bin/time -v: adds peak_rss_mib (max RSS of the process it ran).

    Dirty pages are flushed first: otherwise the writeback of what the previous method wrote
    (gigabytes, for the merge) runs during this one and takes its CPU."""
    tfile = WORK / f".time-{os.getpid()}-{time.monotonic_ns()}"
    WORK.mkdir(parents=True, exist_ok=True)
    os.sync()
    res = run(["/usr/bin/time", "-v", "-o", str(tfile), *argv], **kw)
    try:
        for line in tfile.read_text().splitlines():
            if "Maximum resident set size" in line:
                res["peak_rss_mib"] = int(line.split(":")[-1]) / 1024
        tfile.unlink()
    except OSError:
        pass
    return res


# Generated Llama-architecture bf16 checkpoints for the size sweeps (conversion, merge):
# (layers, hidden, intermediate, vocab); heads of 64, a KV head per 8 query heads (_merge_children.gen).
# 1.1 B is TinyLlama-1.1B's shape. QUICK: two small sizes.
SIZES: dict[str, tuple[int, int, int, int]] = (
    {"0.05 B": (2, 768, 2048, 32000), "0.1 B": (4, 1024, 2816, 32000)}
    if QUICK
    else {
        "0.1 B": (8, 768, 2048, 32000),
        "0.5 B": (16, 1536, 4096, 32000),
        "1.1 B": (22, 2048, 5632, 32000),
        "2.9 B": (28, 3072, 8192, 32000),
    }
)
TARGET_SIZE = "0.1 B" if QUICK else "1.1 B"  # the size issue 18's conversion and merge targets name


# Imported once per environment before any measurement: without this the first child of a comparison
# would also compile the modules of JAX, MaxText, vLLM... (20+ s) while the others find them compiled.
# The step programs' lazy imports are listed too (vLLM's engine, the control steps'): the local stack's
# steps compile into the environments' own caches (see compile_imports).
WARM = {
    "control": ["airflow.dag_processing.dagbag", "operators.dag_factory", "loraflow.dev.demo", "google.cloud.storage",
                "loraflow.steps.validate_data", "great_expectations", "great_expectations.expectations",
                "loraflow.steps.gate", "loraflow.steps.publish", "loraflow.steps.report"],
    "trainer": ["loraflow.steps.convert_checkpoint", "loraflow.steps.lora_sft", "loraflow.steps.merge_adapter",
                "loraflow.lora.merge", "maxtext.checkpoint_conversion.to_maxtext",
                "maxtext.trainers.post_train.sft.train_sft", "transformers"],
    "serving": ["loraflow.steps.evaluate", "vllm", "vllm.entrypoints.llm", "transformers", "peft"],
}  # fmt: skip


def compile_imports(environ: dict[str, str]) -> None:
    """Import :data:`WARM` in each environment with ``environ``, so that its bytecode is compiled where
    that environment keeps it: the benchmark's children share ``env()``'s cache; the local stack's step
    programs get ``loraflow.launchers.local.step_environment()``, without that prefix, and so compile into
    each virtual environment's own ``__pycache__`` (as a deployed image has it, compiled at build)."""
    for venv, modules in WARM.items():
        src = f"import importlib\nfor m in {modules!r}:\n    try:\n        importlib.import_module(m)\n    except Exception:\n        pass"
        subprocess.run([PY[venv], "-c", src], env=environ, cwd=REPO, capture_output=True, check=False)


def generated_checkpoint(size: str) -> tuple[Path, dict[str, Any]]:
    """The generated checkpoint of ``size`` under WORK/models (made once, then reused by every sweep) and
    its facts (parameters, bytes, shards, largest tensor, adapter parameters); ``<dir>/base``, ``<dir>/adapter``."""
    root = WORK / "models" / "x".join(map(str, SIZES[size]))  # by shape: a QUICK size may share a label
    facts = root / "facts.json"
    if not facts.exists():
        shutil.rmtree(root, ignore_errors=True)
        say(f"generating the {size} checkpoint {SIZES[size]}")
        child = str(BENCH / "_merge_children.py")
        r = run([PY["serving"], child, "gen", str(root), *map(str, SIZES[size])], timeout=3600)
        if r["rc"] != 0:
            raise SystemExit(f"generating the {size} checkpoint failed: {r.get('stderr_tail', '')[-1500:]}")
        facts.write_text(json.dumps({k: v for k, v in r.items() if k not in ("wall_s", "rc")}))
    return root, json.loads(facts.read_text())


def tinymodel_checkpoint(dest: Path, dims: dict[str, int] | None = None) -> tuple[Path, int]:
    """A model of loraflow's tiny family (tokenizer included: trainable and servable) at ``dest``, made once:
    the tiny model itself, or ``dims`` (``loraflow.dev.tinymodel.DIMS``'s keys) for a larger one; and its
    parameter count."""
    corpus = REPO / "pipelines" / "data" / "parity" / "train.jsonl"
    if not (dest / "model.safetensors").exists():
        code = (
            "import sys; from pathlib import Path; from loraflow.dev import tinymodel; "
            f"tinymodel.create(Path(sys.argv[1]), [Path({str(corpus)!r})]" + (f", dims={dims!r})" if dims else ")")
        )
        r = run([PY["serving"], "-c", code, str(dest)], timeout=1800)
        if r["rc"] != 0:
            raise SystemExit(f"making the model at {dest} failed: {r.get('stderr_tail', '')[-1500:]}")
    c = json.loads((dest / "config.json").read_text())
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return dest, n * (2 * d * q + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d


def memory_bytes() -> int:
    """This machine's RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def interleaved(reps: int, sizes: Iterable[str], methods: dict[str, str]) -> Iterator[tuple[int, str, str, str]]:
    """(repetition, size, method label, mode) in a sweep's order: per repetition, per size, every method."""
    sizes = list(sizes)
    for rep in range(reps):
        for size in sizes:
            for label, mode in methods.items():
                yield rep, size, label, mode


def run_or_stop(what: str, argv: list[str], **kw: Any) -> dict[str, Any]:
    """:func:`run_timed`, ending the benchmark with the child's error when it fails."""
    r = run_timed(argv, **kw)
    if r["rc"] != 0:
        raise SystemExit(f"{what} failed: {r.get('stderr_tail', '')[-1500:]}")
    return r


def emit(data: dict[str, Any]) -> None:
    """What a child prints last for :func:`run` to pick up."""
    print("BENCH_JSON " + json.dumps(data), flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def medians(runs: list[dict[str, Any]], *keys: str) -> dict[str, float]:
    """``{"median_<key>": median over runs}`` for each key (runs without the key are left out)."""
    return {f"median_{k}": median([r[k] for r in runs if k in r]) for k in keys}


# The flags that decide which kernels run (loraflow's merge kernel, OpenBLAS, XLA, vLLM's CPU backend).
CPU_FLAGS = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16"]


def cpu_line(m: dict[str, Any]) -> str:
    """``Intel(R) Xeon(R) ... (avx2, fma, avx512f, ...)``: the CPU a result was measured on."""
    return f"{m.get('cpu_model', '?')} ({', '.join(m.get('cpu_flags', [])) or 'flags not recorded'})"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    try:
        mem = Path("/proc/meminfo").read_text().split("\n")[0]
        info["memory"] = mem.split(":")[1].strip()
        cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
        info["cpu_model"] = cpu[0].split(":")[1].strip() if cpu else "?"
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])  # fmt: skip
        info["cpu_flags"] = [f for f in CPU_FLAGS if f in flags]
    except OSError:
        pass
    return info


def save(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data.setdefault("quick", QUICK)
    data.setdefault("loadavg_start", LOAD_AT_IMPORT)
    data.setdefault("loadavg_end", os.getloadavg())
    data.setdefault("saved_at", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"[bench] wrote {path.relative_to(REPO)}", flush=True)
    return path


def say(msg: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {msg}", flush=True)
