"""The ``loraflow`` command: validate and plan pipeline specs, make the tiny model, seed the emulator;
the daily work beside them (registry, runs, trigger, verify) is in loraflow/cli/daily.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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

    plan = describe(load_spec(args.spec), args.run_id)
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
