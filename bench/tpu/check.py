"""The training stage on a TPU chip: loraflow's own convert and lora_sft code, measured (bench/tpu/README.md).

Runs on the TPU machine (after ``bench/tpu/install.sh``), from the repository root::

    python3 bench/tpu/check.py PHASE [--out DIR] [--work DIR]

PHASE ``tiny``: the chip's bf16 matmul rate; the tiny model (carried in ``.tpu-inputs/tiny``, made
here by ``make tpu-inputs`` so that TPU and CPU train the same base) converted, then trained 150 steps
on the parity task with LoRA in float32 and in bfloat16 and with nf4, and once by MaxText's own entry
point. ``1b`` and ``3b``: a generated Llama-3.2-1B / 3B-shaped model (bf16, random) converted, then
LoRA through loraflow and through MaxText's own entry point, and QLoRA int8 and nf4. ``8b``: an
8B Llama-3.1-shaped model with nf4 through MaxText's set-up, from random weights (where it fails on
one chip). ``8b-qlora``: the same model generated, converted, and trained with nf4 through lora_sft.
``vllm-tiny`` and ``vllm-1b``: the evaluate stage on vLLM's TPU backend (:func:`serving`). Every case runs
in a process of its own (``_case.py``, ``_serve_case.py`` for the vLLM ones), stopped if the host's
memory runs short; results go to ``OUT/tpu-PHASE.json`` after each case, so a case that fails or
runs out of time leaves the others'. The tiny phase also writes ``OUT/tpu-tiny-adapters.tar.gz``
(each run's PEFT export and loss.csv) for the CPU-side comparison (``bench/tpu/compare.py``).
Stdlib only: it runs before anything is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASE = str(HERE / "_case.py")
SERVE_CASE = str(HERE / "_serve_case.py")
PROBE = HERE / "probe"  # its sitecustomize samples a process's threads (--probe)
#: a case is stopped when the host's available memory falls below this
MIN_AVAILABLE_BYTES = 3 << 30


def _train(size: str, mode: str, dtype: str, quantization: str, steps: int) -> dict[str, Any]:
    return {"kind": "train", "size": size, "mode": mode, "dtype": dtype, "quantization": quantization, "steps": steps}


def phases() -> dict[str, list[dict[str, Any]]]:
    """Each phase's cases, in order; each must fit one device call (10 minutes) with the install."""
    return {
        "tiny": _tiny(),
        **{size: _large(size) for size in ("1b", "3b")},
        "8b": _frontier(),
        "8b-qlora": _moonshot(),
        "memory": _memory(),
        "tuning": _tuning(),
        **serving(),
    }


def _tiny() -> list[dict[str, Any]]:
    """The chip's matmul rate, then the tiny model through loraflow (float32, bf16, nf4) and MaxText."""
    return [
        {"kind": "matmul"},
        {"kind": "prepare", "size": "tiny", "hf": str(REPO / ".tpu-inputs" / "tiny")},
        _train("tiny", "loraflow", "float32", "none", 150),
        _train("tiny", "loraflow", "bfloat16", "none", 150),
        _train("tiny", "loraflow", "bfloat16", "nf4", 150),
        _train("tiny", "maxtext", "float32", "none", 150),
        # case 2 with MaxText's pipeline in the training process, as before 81f314f (bench/notes.md section 16)
        {**_train("tiny", "loraflow", "bfloat16", "none", 150), "maxtext": ["grain_worker_count=0"]},
    ]


def _large(size: str) -> list[dict[str, Any]]:
    """A generated model of ``size``: MaxText's entry point against loraflow's LoRA, nf4 and int8."""
    return [
        {"kind": "prepare", "size": size},
        _train(size, "maxtext", "bfloat16", "none", 30),
        _train(size, "loraflow", "bfloat16", "none", 30),
        _train(size, "loraflow", "bfloat16", "nf4", 30),
        _train(size, "loraflow", "bfloat16", "int8", 30),  # last: the first a short call leaves out
    ]


def _frontier() -> list[dict[str, Any]]:
    """Can MaxText build an 8B (and a 6B) model on one chip for LoRA / QLoRA? It builds the whole bf16
    model before it reads a checkpoint or quantizes, so these start from random weights (no convert)."""
    cases: list[dict[str, Any]] = []
    for size in ("8b", "6b"):
        cases.append({"kind": "prepare", "size": size, "weights": False})
        cases += [{**_train(size, "maxtext", "bfloat16", q, 5), "init": "random"} for q in ("nf4", "none")]
    return cases


def _moonshot() -> list[dict[str, Any]]:
    """QLoRA of an 8B Llama-3.1-shaped model from a converted checkpoint, through lora_sft, which builds and
    quantizes the model in host memory on one chip (its prepare takes most of a call)."""
    return [
        {"kind": "prepare", "size": "8b"},
        _train("8b", "loraflow", "bfloat16", "nf4", 8),
        # the stage choosing its own remat policy (training.tuning: auto) where the chip has ~6 GiB to spare
        {**_train("8b", "loraflow", "bfloat16", "nf4", 8), "config": {"tuning": "auto"}},
        # nf4 in tiles of 128 values instead of 64 (half the scales to apply in each step's dequantization),
        # against case 1's speed and loss curve (issue 39 item 3: 3,000 tokens/s). 128 is the largest tile
        # that divides every kernel's contracted dimension (attention's out contracts head_dim, 128), as
        # the spec's check demands; 256 failed in qwix on the chip. Measured: no faster than 64 (bench/notes.md
        # section 14).
        {**_train("8b", "loraflow", "bfloat16", "nf4", 8), "config": {"tile_size": 128}},
        # the MLP's first two projections (wi_0, wi_1: 7 GiB each at 8 x 1,024 tokens) kept for the backward in
        # the host's memory instead of recomputed there (MaxText's custom remat, 14 GiB each way a step at
        # ~14 GB/s): plan --fit predicts 9.88 GiB on the chip (bench/notes.md section 18), the 3,000 tokens/s
        # question of issue 39 item 3 against case 1's recompute
        {
            **_train("8b", "loraflow", "bfloat16", "nf4", 8),
            "maxtext": ["remat_policy=custom", "mlpwi_0=offload", "mlpwi_1=offload"],
        },
    ]


def _memory() -> list[dict[str, Any]]:
    """Where the step's peak comes from: the 1.5 B model's LoRA, nf4 and int8 steps, each step's memory
    recorded, with Tunix's default two steps queued on the chip and with one (plan --fit's question).
    Reading the chip's memory each step makes the steps run one at a time: the cases with Tunix's two
    queued steps record only the whole run's peaks."""
    return [
        {"kind": "prepare", "size": "1b"},
        *[_train("1b", "loraflow", "bfloat16", q, 10) for q in ("none", "nf4", "int8")],
        *[
            {**_train("1b", "loraflow", "bfloat16", q, 10), "inflight": 1, "memory_by_step": True}
            for q in ("none", "nf4", "int8")
        ],
    ]


def _tuning() -> list[dict[str, Any]]:
    """What the chip rewards (issue 39 item 2): the 1.5 B LoRA case of ``1b`` (MaxText's default remat
    policy, "full") under the policies that recompute less, each MaxText setting appended to the stage's
    command line; the stage's own choice; then, under ``minimal``, the attention kernel. Same model, data
    and tokens seen."""
    lora = _train("1b", "loraflow", "bfloat16", "none", 30)
    # MaxText's `autoselected` attention is its splash (flash) kernel at 1,024 tokens on a TPU, in blocks
    # of 512: XLA's own attention instead, then splash in one block
    splash_blocks = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")
    attention = (["attention=dot_product"], [f"sa_block_{b}=1024" for b in splash_blocks])
    return [
        {"kind": "prepare", "size": "1b"},
        *[
            {**lora, "maxtext": [f"remat_policy={policy}"]}
            for policy in ("minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj")
        ],
        {**lora, "config": {"tuning": "auto"}},
        *[{**lora, "maxtext": ["remat_policy=minimal", *extra]} for extra in attention],
        # case 1 with MaxText's pipeline in the training process, as before 81f314f (bench/notes.md section 16)
        {**lora, "maxtext": ["remat_policy=minimal", "grain_worker_count=0"]},
    ]


def _evaluate(name: str, model: str, dtype: str, **extra: Any) -> dict[str, Any]:
    config = {"max_new_tokens": 8, "batch_size": 32, "seed": 0, "max_model_len": 512, "dtype": dtype}
    return {"kind": "vllm-evaluate", "name": name, "model": model, "config": config, **extra}


def serving() -> dict[str, list[dict[str, Any]]]:
    """The evaluate stage on vLLM (``_serve_case.py``; installed by ``install_serve.sh``). ``vllm-tiny``: the
    tiny base and the tiny merged model (trained and merged here: ``make tpu-prepare``) through loraflow's
    evaluate and guard, as on CPU; ``vllm-1b``: a 1.5 B Llama-shaped model's generation throughput at the
    default evaluation batch (64) and the production specs' (256), loraflow's stage against raw vLLM."""
    base, merged = ".tpu-inputs/tiny", ".tpu-inputs/vllm/tiny-merged"
    tiny = [
        _evaluate("base-float32", base, "float32"),
        _evaluate("merged-float32", merged, "float32"),
        _evaluate("merged-bfloat16", merged, "bfloat16"),
        _evaluate("merged-float32-highest", merged, "float32", matmul_precision="highest"),
        _evaluate("base-float32-highest", base, "float32", matmul_precision="highest"),
    ]
    throughput = [{"kind": "vllm-throughput", "size": "1b", "batch": b, "repeats": 2} for b in (64, 256)]
    return {"vllm-tiny": tiny, "vllm-1b": [{"kind": "vllm-prepare", "size": "1b"}, *throughput]}


def run_case(case: dict[str, Any], root: Path, log: Path, timeout: float, probe: Path | None = None) -> dict[str, Any]:
    """One case in its own process; its result, or what went wrong with the tail of its output. ``probe``: a
    folder where a training case's process writes where its threads were (:data:`PROBE`)."""
    case = {**case, "root": str(root)}
    env = dict(os.environ)
    if case["kind"] in ("prepare", "vllm-prepare"):
        env["JAX_PLATFORMS"] = "cpu"  # converting needs no chip (and must not hold it)
    if probe is not None and case["kind"] == "train":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE), env.get("PYTHONPATH")) if p)
        env["LORAFLOW_PROBE"] = str(probe)
    script = SERVE_CASE if case["kind"].startswith("vllm-") else CASE
    t = time.perf_counter()
    with log.open("a") as sink:
        sink.write(f"\n===== {json.dumps(case)}\n")
        sink.flush()
        proc = subprocess.Popen(
            [sys.executable, script, json.dumps(case)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        host, watcher = _watch_host_memory(proc)
        try:
            output, _ = proc.communicate(timeout=timeout)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            rc = "timeout"
        watcher.join()  # proc has ended: the watcher's last reading is in
        if "stopped" in host:
            rc = f"stopped: {host['stopped']}"
        sink.write(output)
    wall = time.perf_counter() - t
    found = [line for line in output.splitlines() if line.startswith("BENCH_JSON ")]
    if rc == 0 and found:
        return {**json.loads(found[-1][len("BENCH_JSON ") :]), "wall_s": wall, "host_memory": host}
    return {"case": case, "failed": rc, "wall_s": wall, "host_memory": host, "tail": output[-4000:]}


def _meminfo(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """``keys`` of a /proc file of ``Key: N kB`` lines, in bytes (those it lacks left out)."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def _watch_host_memory(proc: subprocess.Popen[str]) -> tuple[dict[str, Any], threading.Thread]:
    """Watch the host's memory while ``proc`` runs, every 0.5 s: kill it when MemAvailable falls below
    ``MIN_AVAILABLE_BYTES`` (the device machine returns nothing at all when the host runs out; the dict's
    ``stopped`` then says why). The dict also keeps the process's own peaks (``peak_rss_bytes``,
    ``peak_anon_bytes``: VmRSS, RssAnon) beside the machine's MemAvailable as it began, its lowest and the
    page cache then (``available_at_start_bytes``, ``min_available_bytes``, ``cached_bytes_at_min``): under
    gVisor MemAvailable counts the file data the sandbox caches as used, which the process's own figures do
    not (bench/notes.md section 13b). Join the thread once ``proc`` has ended before reading the dict."""
    at_start = _meminfo("/proc/meminfo", ("MemAvailable",)).get("MemAvailable")
    seen: dict[str, Any] = {"available_at_start_bytes": at_start, "peak_rss_bytes": 0, "peak_anon_bytes": 0}

    def watch() -> None:
        while proc.poll() is None:
            mine = _meminfo(f"/proc/{proc.pid}/status", ("VmRSS", "RssAnon"))
            seen["peak_rss_bytes"] = max(seen["peak_rss_bytes"], mine.get("VmRSS", 0))
            seen["peak_anon_bytes"] = max(seen["peak_anon_bytes"], mine.get("RssAnon", 0))
            host = _meminfo("/proc/meminfo", ("MemAvailable", "Cached"))
            available = host.get("MemAvailable")
            if available is not None and available < seen.get("min_available_bytes", 1 << 62):
                seen["min_available_bytes"], seen["cached_bytes_at_min"] = available, host.get("Cached")
            if available is not None and available < MIN_AVAILABLE_BYTES:
                seen["stopped"] = f"host memory ran short ({available / 2**30:.1f} GiB available)"
                proc.kill()
                return
            time.sleep(0.5)

    watcher = threading.Thread(target=watch if os.path.exists("/proc/meminfo") else lambda: None, daemon=True)
    watcher.start()
    return seen, watcher


def pack_adapters(root: Path, dest: Path) -> None:
    """Every tiny run's peft/ and loss.csv, for the CPU-side merge and comparison."""
    with tarfile.open(dest, "w:gz") as tar:
        for run in sorted((root / "runs").glob("*")):
            for name in ("peft/adapter_model.safetensors", "peft/adapter_config.json", "loss.csv"):
                path = run / "out" / name
                if path.is_file():
                    tar.add(path, arcname=f"{run.name}/{name}")


def _since_call_started() -> float:
    """Seconds since the device call began (``$CALL_STARTED``, epoch seconds), 0 where unset or unreadable."""
    try:
        return max(0.0, time.time() - float(os.environ.get("CALL_STARTED", "")))
    except ValueError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    table = phases()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("phase", choices=sorted(table))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/tpu-out")))
    p.add_argument("--work", type=Path, default=Path("/tmp/tpu-work"))
    p.add_argument(
        "--budget",
        type=float,
        default=560.0,
        help="seconds for the whole device call: counted from $CALL_STARTED (epoch seconds, set first in the call: "
        "the install's time counts too) where set, else from now",
    )
    p.add_argument("--steps", type=int, help="train this many steps in every case (a quick rehearsal on CPU)")
    p.add_argument(
        "--probe",
        action="store_true",
        help="the training cases' processes sample where their threads are every 10 ms, and time their full garbage "
        "collections, into OUT/probe (bench/tpu/probe_report.py reads it): what a slow step waited for",
    )
    p.add_argument(
        "--cases",
        type=lambda text: [int(i) for i in text.split(",")],
        help="run only these of the phase's cases, by index from 0, comma-separated (e.g. 0,1,2 then 3,4 in a "
        "second call on the same warm machine: the work folder keeps the prepared model)",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.work / args.phase
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget - _since_call_started()
    # An earlier call's results on this machine (a phase split over calls with --cases) are kept:
    # every call writes the whole phase so far.
    kept = root / "results.json"
    earlier = json.loads(kept.read_text()) if args.cases and kept.is_file() else []
    results: list[dict[str, Any]] = []
    cases = table[args.phase]
    for case in [cases[i] for i in args.cases] if args.cases else cases:
        if args.steps and case["kind"] == "train":
            case = {**case, "steps": args.steps}
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"case": case, "failed": "no time left in this call"})
            continue
        print(f"[tpu-check] {time.strftime('%H:%M:%S')} {json.dumps(case)} ({left:.0f}s left)", flush=True)
        res = run_case(case, root, args.out / f"tpu-{args.phase}.log", left, args.out / "probe" if args.probe else None)
        results.append(res)
        shown = ("failed", "skipped", "wall_s", "tokens_per_s", "step_s_median", "summary", "warm_tokens_per_s")
        brief = {k: res[k] for k in (*shown, "stage_over_raw", "peak_bytes_in_use", "host_memory") if k in res}
        print(f"[tpu-check] -> {json.dumps(brief, default=str)}", flush=True)
        so_far = earlier + results
        kept.write_text(json.dumps(so_far))
        done = {"phase": args.phase, "saved_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "results": so_far}
        (args.out / f"tpu-{args.phase}.json").write_text(json.dumps(done, indent=1))
        if case["kind"] in ("prepare", "vllm-prepare") and "failed" in res and case["size"] != "8b":
            break  # nothing to train
    if args.phase == "tiny":
        pack_adapters(root, args.out / "tpu-tiny-adapters.tar.gz")
    return 0 if all("failed" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
