"""The ``loraflow`` command: validate and plan pipeline specs, make the tiny model, seed the emulator;
the daily work beside them (registry, runs, trigger, verify) is in loraflow/cli/daily.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loraflow.cli.daily import add_commands
from loraflow.errors import LoraflowError, SpecError
from loraflow.spec.locate import PIPELINES_DEFAULT, pipelines_dir


def _specs(paths: list[Path]) -> list[Path]:
    from loraflow.spec.cache import discover

    if not paths:
        return discover(pipelines_dir())
    out: list[Path] = []
    for p in paths:
        out += discover(p) if p.is_dir() else [p]
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from loraflow.spec.schema import load_spec

    bad = 0
    specs = _specs(args.specs)
    if not specs:
        print("no pipeline specs found", file=sys.stderr)
        return 1
    for path in specs:
        try:
            spec = load_spec(path)
            print(f"ok       {path}  ({spec.name})")
        except SpecError as exc:
            bad += 1
            print(f"INVALID  {exc}", file=sys.stderr)
    print(f"{len(specs) - bad} valid, {bad} invalid")
    return 1 if bad else 0


def cmd_plan(args: argparse.Namespace) -> int:
    from loraflow.launchers.registry import LAUNCHERS
    from loraflow.pipeline.plan import describe
    from loraflow.spec.schema import load_spec

    spec = load_spec(args.spec)
    if args.fit:
        return cmd_fit(spec, args.json)
    plan = describe(spec, args.run_id)
    requests = [launcher.plan_request for launcher in LAUNCHERS.values() if launcher.plan_request]
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    print(f"pipeline {plan['pipeline']}  run {plan['run_id']}  artifacts under {plan['artifact_root']}")
    for s in plan["stages"]:
        after = ", ".join(s["after"]) or "-"
        print(f"\n{s['stage']}  (after: {after}; env: {s['environment']}; launcher: {s['launcher']})")
        print(f"  output: {s['output']}/")
        print("  argv:   " + " ".join(_quote(a) for a in s["argv"]))
        for request in (r for r in requests if r.key in s):
            print(f"  {request.title} (not sent; CACHE_KEY and LOCK are filled in at run time):")
            print("  " + json.dumps(s[request.key], indent=2).replace("\n", "\n  "))
    return 0


def cmd_fit(spec: Any, as_json: bool) -> int:
    """``plan --fit``: the predicted peak HBM per chip of the spec's lora_sft on its slice (computed in the
    trainer environment, :mod:`loraflow.trainer.fit`); 0 when it fits, 1 when it does not."""
    from loraflow.spec.fit import lora_sft_slice
    from loraflow.spec.step_configs import LoraSftConfig

    target = lora_sft_slice(spec.compute_for("lora_sft"))
    config = LoraSftConfig.from_spec(spec).wire()
    result = run_fit(config, target.machine_type, target.topology)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(fit_text(spec.name, config, result))
    return 0 if result["verdict"]["fits"] else 1


def run_fit(config: dict[str, Any], machine_type: str, topology: str) -> dict[str, Any]:
    """``python -m loraflow.trainer.fit`` in the trainer environment: its JSON answer (the control
    environment never imports JAX)."""
    import subprocess

    from loraflow.launchers.environments import ENVIRONMENTS

    python = ENVIRONMENTS["trainer"].local_python()
    argv = [str(python), "-m", "loraflow.trainer.fit", "--config-json", json.dumps(config)]
    ran = subprocess.run(
        [*argv, "--machine-type", machine_type, "--topology", topology], capture_output=True, text=True, check=False
    )
    lines = ran.stdout.strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if "error" in answer:
        raise LoraflowError(str(answer["error"]))
    if ran.returncode != 0 or "verdict" not in answer:
        tail = "\n".join(ran.stderr.strip().splitlines()[-15:])
        raise LoraflowError(f"the prediction failed in the trainer environment (exit {ran.returncode}):\n{tail}")
    return answer


def fit_text(name: str, config: dict[str, Any], result: dict[str, Any]) -> str:
    """What ``plan --fit`` prints: the slice, the peak and its parts, the verdict, the largest batch."""
    asked, verdict, step = result["asked"], result["verdict"], result["asked"]["step"]
    per_chip = asked["per_device_batch"]
    peak, queued = _size(asked["peak_bytes"]), _size(asked["queued_bytes"])
    # a queued step holds more only where the step writes outputs of its own (not over donated arguments)
    queued_note = f" (up to {queued} while a second step is queued, where the chip has room for it)"
    lines = [
        f"pipeline {name}: lora_sft on {result['describe']}, {_size(result['hbm_bytes'])} of HBM per chip "
        f"({result['hbm_source']})",
        f"  batch {config['batch_size']} ({per_chip:g} per chip) x {config['max_length']} tokens, "
        f"{config['dtype']}, quantization {config['quantization']}: predicted peak {peak} per chip"
        f"{queued_note if queued != peak else ''}",
        f"    train step (XLA's memory analysis): arguments {_size(step['argument_bytes'])}, outputs "
        f"{_size(step['output_bytes'] - step['alias_bytes'])} not over donated ones, temporaries "
        f"{_size(step['temp_bytes'])}; set-up {_size(asked['setup_bytes'])}",
    ]
    if step.get("host_bytes"):  # a remat policy that offloads: the host's memory holds it, per chip
        lines.append(
            f"    and {_size(step['host_bytes'])} per chip in the host's memory (what the remat policy offloads), "
            "not in the peak: a host's memory must hold it for each of its chips"
        )
    tuned = result.get("tuning")
    if tuned is not None:
        each = ", ".join(f"{policy} {_size(peak)}" for policy, peak in tuned["peaks"].items())
        how = "the first that fits, least recomputed first" if tuned["fits"] else "none fits: MaxText's default"
        lines.append(f"  training.tuning: auto: remat_policy={tuned['remat_policy']} ({how}); predicted peaks: {each}")
    margin = verdict["margin_bytes"]
    if verdict["fits"]:
        lines.append(f"  fits: {_size(margin)} to spare")
    else:
        lines.append(f"  does NOT fit: {_size(-margin)} short")
    largest = verdict["largest_batch"]
    if largest > 0:
        lines.append(
            f"  largest per-device batch that fits: {largest} (training.batch_size {largest * result['chips']})"
        )
    elif largest == 0:
        lines.append("  no batch fits: not even one row per chip; use more chips or QLoRA (lora.quantization)")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def cmd_seed(args: argparse.Namespace) -> int:
    from loraflow.dev.demo import seed_sources

    for line in seed_sources(args.spec, args.model_dir):
        print(line)
    return 0


def cmd_spec_reference(args: argparse.Namespace) -> int:
    from loraflow.spec.reference import render

    print(render(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loraflow",
        description="Declarative LoRA fine-tuning pipelines on Airflow. Specs live in pipelines/*.yaml.",
        epilog="Run `make demo` to run the tiny pipeline end to end; see docs/quickstart.md. Day-2 operations "
        "(registry, runs, trigger, verify): docs/operations.md. `loraflow COMMAND --help` for each.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check pipeline specs; print every problem; exit 1 if any is invalid")
    v.add_argument(
        "specs",
        nargs="*",
        type=Path,
        help=f"spec files or folders (default: {PIPELINES_DEFAULT})",
    )
    v.set_defaults(fn=cmd_validate)
    pl = sub.add_parser("plan", help="print the resolved plan of a spec: stages, environments, argv, URIs")
    pl.add_argument("spec", type=Path)
    pl.add_argument("--run-id", default="RUN_ID", help="run id to show in the artifact URIs")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument(
        "--fit",
        action="store_true",
        help="predict lora_sft's peak HBM per chip on the slice compute.lora_sft names (no chip needed; minutes: "
        "the train step is compiled for that TPU in the trainer environment); says whether it fits, the margin and "
        "the largest per-device batch that fits; exit 1 when it does not fit",
    )
    pl.set_defaults(fn=cmd_plan)
    r = sub.add_parser("spec-reference", help="print the spec reference (markdown) generated from the schema")
    r.set_defaults(fn=cmd_spec_reference)
    s = sub.add_parser("seed", help="upload a spec's tiny model and datasets to the (emulated) GCS bucket")
    s.add_argument("spec", type=Path)
    s.add_argument(
        "--model-dir", type=Path, required=True, help="the tiny HF checkpoint made by loraflow.dev.tinymodel"
    )
    s.set_defaults(fn=cmd_seed)
    add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.fn(args)
        return rc
    except LoraflowError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
