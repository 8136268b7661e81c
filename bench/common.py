"""Shared helpers for the benchmarks: run a child in one of the venvs, measure wall time and peak RSS.

Runs under any of the three interpreters (stdlib only). Timings are wall-clock; peak RSS is the
child's own ru_maxrss from wait4 (its grandchildren are not counted, and none of the measured
commands spawn any unless said so).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
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


def emit(data: dict[str, Any]) -> None:
    """What a child prints last for :func:`run` to pick up."""
    print("BENCH_JSON " + json.dumps(data), flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


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
