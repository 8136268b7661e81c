"""Mutation testing of the modules where a silent bug costs most (``make mutate``; docs/mutation.md).

For each target: a scratch copy of the repository under ``.mutate/<target>/``, mutmut configured
there (setup.cfg) to mutate the target's files (or only the named functions) and to run only the
target's fast test files, in the environment those tests need. Then one table of killed / survived
per target, and every surviving mutant's diff, in ``.mutate/report.md``.

    python tools/mutate.py                 # every target
    python tools/mutate.py gate_rule spec  # some
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".mutate"
COPY = ["loraflow", "operators", "dags", "pipelines", "docs", "envs", "tests", "pyproject.toml"]


@dataclass(frozen=True)
class Target:
    env: str  # control | trainer
    files: list[str]  # what mutmut mutates
    tests: list[str]  # the only tests it runs (pytest node ids or files)
    functions: list[str] = field(default_factory=list)  # mutant name globs; empty: every function of files
    default: bool = True  # part of a plain `make mutate`
    # Slow tests left out of the selection (seconds for each mutant that reaches them); what they cover
    # beyond the target's other tests is said in docs/mutation.md.
    deselect: list[str] = field(default_factory=list)


# The tests of test_launch_and_runner.py that start real step programs (seconds each).
RUNNER_SLOW = [
    f"tests/control/test_launch_and_runner.py::{name}"
    for name in (
        "test_second_run_of_a_stage_is_a_cache_hit",
        "test_a_rerun_on_changed_inputs_in_the_same_run_commits_beside_the_first",
        "test_kill_stops_the_step_and_its_children",
        "test_lines_are_streamed_as_they_come",
        "test_a_failing_step_raises_with_its_last_error_line",
    )
]

TRUST_ARTIFACTS = [
    "test_fetch_refuses_a_hostile_manifest_and_writes_nothing",
    "test_a_hostile_object_name_under_a_source_prefix_is_refused_before_any_download",
    "test_a_step_never_uploads_a_name_readers_would_refuse",
    "test_a_cache_entry_pointing_at_a_commit_of_its_stage_is_a_hit",
    "test_a_cache_entry_pointing_anywhere_else_is_a_miss_and_the_log_says_why",
    "test_a_cache_entry_whose_manifest_claims_another_stage_is_a_miss",
    "test_garbage_in_a_cache_entry_is_a_miss",
    "test_the_cache_never_stores_a_pointer_it_would_refuse",
]

JSON_OBJECTS = [
    "test_nesting_is_counted_outside_strings_and_the_limit_is_inclusive",
    "test_the_parser_refuses_with_a_value_error_never_a_recursion_error",
    "test_a_string_number_and_null_are_not_objects",
    "test_a_local_file_is_read_with_the_same_bounds",
    "test_a_local_file_that_is_not_utf8_is_refused_with_the_callers_fix",
    "test_an_object_listed_over_its_cap_is_refused_before_a_byte_is_read",
    "test_an_object_is_read_only_up_to_its_cap",
    "test_an_empty_object_is_not_json_and_a_missing_one_is_none",
    "test_read_manifest_refuses_a_bad_manifest_naming_it",
    "test_a_bad_manifest_behind_a_cache_entry_is_a_miss_and_the_log_says_why",
    "test_a_bad_cache_entry_is_a_miss_and_the_log_says_why",
    "test_the_next_commit_goes_beside_a_bad_manifest",
]

GUARDS_CHAMPION = [
    "test_without_a_champion_the_base_comparison_decides",
    "test_a_better_champion_blocks_promotion",
    "test_a_tie_with_the_champion_is_not_a_win",
    "test_beating_the_champion_promotes_and_says_against_whom",
    "test_the_champion_itself_is_never_promoted_again",
    "test_the_champion_moving_changes_the_decision",
]

# test_trust_bucket.py's tests of the champion as the gate reads it (registry/store.py)
TRUST_CHAMPION = [
    "test_a_champion_registered_as_publish_writes_it_is_read_with_its_verified_evaluation",
    "test_a_champion_alias_pointing_elsewhere_is_refused",
    "test_a_champion_the_gate_cannot_verify_is_refused_naming_the_version_and_the_repair",
]

# test_suites.py's tests of the gate step guarding on a suite (gate.guard.suite)
SUITE_GUARD_STEP = [
    "test_the_gate_step_refuses_a_model_that_lost_ground_on_a_guarding_suite",
    "test_the_gate_steps_suite_guard_takes_the_specs_settings_and_names_an_evaluation_without_the_suite",
]

TARGETS: dict[str, Target] = {
    # artifacts.py is read by the runner (input identities, the cache): its fast tests count here too.
    # json_objects.py is how it (and every other reader of GCS JSON) parses what a bucket writer wrote.
    "artifacts": Target(
        "control",
        ["loraflow/storage/artifacts.py", "loraflow/storage/json_objects.py"],
        [
            "tests/control/test_artifacts.py",
            # the parser and the readers in artifacts.py; the champion, gate and promote tests of that file
            # register whole champions (seconds for each mutant that reaches them) and test registry code
            *[f"tests/control/test_json_objects.py::{t}" for t in JSON_OBJECTS],
            "tests/control/test_launch_and_runner.py",
            # the bucket-writer lane's refusals that live in artifacts.py (hostile manifests, sources, cache entries)
            *[f"tests/control/test_trust_bucket.py::{t}" for t in TRUST_ARTIFACTS],
        ],
        deselect=RUNNER_SLOW,
    ),
    "gate_rule": Target(
        "control",
        ["loraflow/evaluation/gate_rule.py"],
        ["tests/control/test_gate.py", "tests/control/test_regression_guard.py"],
    ),
    # The regression guard's path outside gate_rule: the set and its scoring rule, what the evaluate step
    # scores of each option (its vLLM half, sequences and score, is tests/serving's), what the gate reads.
    "guard": Target(
        "control",
        ["loraflow/evaluation/guard.py", "loraflow/steps/_guard.py", "loraflow/steps/gate.py"],
        [
            "tests/control/test_regression_guard.py",
            # the gate step with a guard on a suite (gate.guard.suite): _guard_check's other branch
            *[f"tests/control/test_suites.py::{t}" for t in SUITE_GUARD_STEP],
        ],
        [
            "loraflow.evaluation.guard.*",
            "loraflow.steps._guard.x_load__mutmut_*",
            "loraflow.steps._guard.x_continuations__mutmut_*",
            *[f"loraflow.steps.gate.x_{f}__mutmut_*" for f in ("load_guard", "_guard_row", "_guard_check")],
        ],
    ),
    # The planning half of the merge; the numerics (merge_lora, the kernel) have their own reference tests.
    "merge": Target(
        "trainer",
        ["loraflow/lora/merge.py"],
        ["tests/trainer/test_merge.py"],
        [
            "loraflow.lora.merge.x_plan_merge__mutmut_*",
            "loraflow.lora.merge.x_lora_scale__mutmut_*",
            "loraflow.lora.merge.x_load_adapter_config__mutmut_*",
            "loraflow.lora.merge.x__pattern_key__mutmut_*",
            "loraflow.lora.merge.x_peft_module__mutmut_*",
            "loraflow.lora.merge.xǁLoraConfigǁ*",
        ],
    ),
    "handoff": Target(
        "control",
        ["loraflow/pipeline/handoff.py"],
        ["tests/control/test_handoff.py"],
        # builds the hand-off DAG (5 s): the operators' wiring, not handoff.py's decisions
        deselect=["tests/control/test_handoff.py::test_a_handoff_pipeline_is_wrapped_in_pick_and_verdict"],
    ),
    # The registry: store.py is read by the gate step (the champion comparison), written by publish; the
    # alias moves, the audit trail and the operators' list/promote/rollback (the CLI's and the DAG's).
    "registry": Target(
        "control",
        [
            "loraflow/registry/store.py",
            "loraflow/steps/publish.py",
            "loraflow/registry/alias.py",
            "loraflow/registry/audit.py",
            "loraflow/registry/operations.py",
        ],
        [
            "tests/control/test_publish.py",
            "tests/control/test_gate.py",
            # the champion as the gate reads it, and the aliases and versions it refuses
            *[f"tests/control/test_guards.py::{t}" for t in GUARDS_CHAMPION],
            *[f"tests/control/test_trust_bucket.py::{t}" for t in TRUST_CHAMPION],
            "tests/control/test_registry_operations.py",
            "tests/control/test_registry_listing.py",
        ],
        # the Vertex AI Model Registry mirror through its stand-in server (1-6 s each); operations' own
        # mirror calls are pinned by test_registry_operations.py's stand-in (Mirror) instead
        deselect=[
            "tests/control/test_publish.py::test_vertex_model_registry_mirrors_versions_and_the_champion_alias",
            "tests/control/test_registry_operations.py::test_moves_are_mirrored_to_the_vertex_model_registry",
            "tests/control/test_registry_operations.py::"
            "test_a_version_missing_from_vertex_fails_the_mirror_and_says_how_to_repair_it",
        ],
    ),
    # The runner around a stand-in step (FakeStep); the tests that start real step programs are left out.
    "runner": Target(
        "control",
        ["loraflow/pipeline/runner.py"],
        ["tests/control/test_launch_and_runner.py"],
        deselect=RUNNER_SLOW,
    ),
    # make test's lanes: real make on small Makefiles (seconds a mutant).
    "lanes": Target("control", ["loraflow/dev/lanes.py"], ["tests/control/test_lanes.py"], default=False),
    # plan --fit's arithmetic and slices (the prediction itself compiles for a TPU: tests/trainer/test_fit.py).
    "fit": Target("control", ["loraflow/spec/fit.py"], ["tests/control/test_fit.py"], default=False),
    # training.tuning: auto's candidates, the refusal beside a remat_policy and the choice (the trainer's use of
    # it compiles: tests/trainer/test_tuning.py)
    "tuning": Target("control", ["loraflow/spec/tuning.py"], ["tests/control/test_tuning.py"], default=False),
    # The end-to-end stacks' one migrate per test run (its copies' paths and keys, when a stack copies).
    # the train step's donation, in Tunix's own training loop (a tiny nnx model: no MaxText)
    "donation": Target("trainer", ["loraflow/trainer/donation.py"], ["tests/trainer/test_donation.py"], default=False),
    # the training curves' scalars and which steps read the device's memory (a read waits for the chip)
    "curves": Target("trainer", ["loraflow/trainer/curves.py"], ["tests/trainer/test_curves.py"], default=False),
    # the training batches read ahead of the step in a thread: same order, the pipeline's end and errors, no thread left
    "batches_ahead": Target(
        "trainer", ["loraflow/trainer/batches_ahead.py"], ["tests/trainer/test_batches_ahead.py"], default=False
    ),
    # a data pipeline's exception, which MaxText swallows, kept and named in lora_sft's error (MaxText's own data
    # hooks around a stand-in iterator; the tiny model's failing run is test_trainer_steps.py's)
    "data_failure": Target(
        "trainer", ["loraflow/trainer/data_failure.py"], ["tests/trainer/test_data_failure.py"], default=False
    ),
    "db_template": Target(
        "control", ["loraflow/dev/db_template.py"], ["tests/control/test_db_template.py"], default=False
    ),
    # The stack end-to-end modules share: which specs it takes, its env, the order that groups its modules.
    "shared_stack": Target(
        "control", ["loraflow/dev/shared_stack.py"], ["tests/control/test_shared_stack.py"], default=False
    ),
    "stages": Target(
        "control",
        ["operators/stages.py"],
        ["tests/control/test_dags.py::test_trigger_values_reach_the_resolved_spec"],
        ["operators.stages.x_resolve_spec__mutmut_*"],
    ),
    # Chat templates: the renderer's rules (train == eval pieces) and the bounded sandbox's parent side
    # (template_worker.py runs isolated in a child, out of mutmut's reach: its bounds are pinned by behaviour).
    "chat_template": Target(
        "control",
        ["loraflow/data/chat_template.py", "loraflow/data/template_sandbox.py"],
        ["tests/control/test_chat_template.py"],
        deselect=[
            # each runs validate_data (GX, a tokenizer: seconds each); the refusals they reach are pinned above
            *[
                f"tests/control/test_chat_template.py::{t}"
                for t in (
                    "test_validate_data_hands_the_resolved_template_on",
                    "test_validate_data_names_the_rows_a_template_refuses",
                    "test_validate_data_stops_at_the_first_row_a_template_breaks_a_bound_on",
                    "test_validate_data_refuses_a_named_template_the_tokenizer_lacks",
                    "test_the_renderer_dies_with_the_process_that_started_it",
                )
            ],
        ],
    ),
    # Which vLLM build an evaluate stage's image must be (compute.<stage>.serving_build) for what its machine
    # carries, and the lock its cache key holds; the rest of compute.py (each launcher's keys) is test_spec's.
    "serving_builds": Target(
        "control",
        ["loraflow/spec/machines.py", "loraflow/spec/compute.py", "loraflow/launchers/environments.py"],
        [
            "tests/control/test_serving_builds.py",
            "tests/control/test_vertex.py::test_gpu_machine_types_name_their_accelerator",
        ],
        [
            "loraflow.spec.machines.*",
            *[
                f"loraflow.spec.compute.x_{f}__mutmut_*"
                for f in ("tagged_build", "serving_build_problem", "serving_build_problems")
            ],
            "loraflow.launchers.environments.x_environment_for__mutmut_*",
        ],
        # they read the Makefile, the Dockerfile and docker/cloudbuild.yaml, which the scratch copy leaves out
        deselect=[
            f"tests/control/test_serving_builds.py::{t}"
            for t in (
                "test_the_cloud_build_config_builds_every_image_the_specs_name",
                "test_make_lock_resolves_every_lock_and_the_dockerfile_installs_each_build",
                "test_the_environments_ci_and_the_demo_install_only_the_cpu_serving_lock",
            )
        ],
    ),
    # What a spec may put into a step's environment (env_rules) and into MaxText's arguments (override_rules):
    # the allow-lists' checks, through the tests that hold them to what a spec author writes.
    "spec_rules": Target(
        "control",
        ["loraflow/spec/env_rules.py", "loraflow/spec/override_rules.py"],
        [
            "tests/control/test_env_rules.py",
            "tests/control/test_override_allow_list.py",
            "tests/control/test_spec.py::test_model_overrides_off_the_allow_list_or_of_another_value_are_refused",
            "tests/control/test_spec.py::test_plain_model_overrides_pass",
            "tests/control/test_hostile_specs.py::test_a_hostile_value_is_refused_naming_its_key_and_the_rule",
        ],
    ),
    # What each stage reports to OpenLineage (the stage operators' hooks send it through operators/lineage.py).
    "lineage": Target(
        "control",
        ["loraflow/pipeline/lineage.py"],
        ["tests/control/test_lineage.py"],
        # two Airflow imports in child processes (seconds); it pins the provider's switch, not this module
        deselect=["tests/control/test_lineage.py::test_lineage_is_off_until_the_openlineage_provider_is_configured"],
    ),
    # Standard benchmarks (evaluation.suites): a staged task's confinement, the LM wrapper's translation of
    # lm-eval's requests and vLLM's answers, a suite's result, and the guard on a suite (gate_rule's and the
    # gate step's share of it); the wrapper's vLLM half is tests/serving's (against lm-eval's own backend).
    "suites": Target(
        "control",
        ["loraflow/evaluation/suites.py", "loraflow/evaluation/gate_rule.py", "loraflow/steps/gate.py"],
        ["tests/control/test_suites.py"],
        [
            "loraflow.evaluation.suites.*",
            "loraflow.evaluation.gate_rule.x_suite_guard_check__mutmut_*",
            "loraflow.steps.gate.x__suite_entry__mutmut_*",
        ],
    ),
    # The gate's and publish's summaries as everything after the gate reads them (issue 38 item 3).
    "summaries": Target("control", ["loraflow/storage/summaries.py"], ["tests/control/test_summaries.py"]),
    # tracking.vertex: what the report logs to Vertex AI Experiments (against the Vertex stand-in).
    "tracking": Target(
        "control",
        ["loraflow/reporting/vertex_tracking.py", "loraflow/steps/_tracking.py"],
        ["tests/control/test_vertex_tracking.py"],
        default=False,  # each mutant logs a run through google-cloud-aiplatform (20-40 s): on demand
    ),
    # Last: the longest list of test files.
    "spec": Target(
        "control",
        ["loraflow/spec/schema.py"],
        [
            "tests/control/test_spec.py",
            "tests/control/test_spec_corpus.py",
            "tests/control/test_plan_and_cli.py",
            "tests/control/test_trigger_params.py",
            # the spec author's lane: each hostile value and file, every number setting, cron expressions
            *[
                f"tests/control/test_hostile_specs.py::{t}"
                for t in (
                    "test_a_hostile_value_is_refused_naming_its_key_and_the_rule",
                    "test_a_hostile_file_is_refused_before_it_is_validated",
                    "test_every_number_of_the_schema_is_finite_and_bounded",
                    "test_every_number_of_the_schema_is_a_number_never_a_boolean_or_text",
                    "test_a_yaml_boolean_or_quoted_share_is_no_max_drop",
                    "test_a_cron_expression_the_schema_accepts_is_one_airflow_takes_and_that_fires",
                )
            ],
        ],
        # parses the DAG folder with the whole hostile corpus (5 s); each spec of it is validated in test_spec_corpus
        deselect=[
            "tests/control/test_spec_corpus.py::test_the_whole_corpus_in_the_dag_folder_leaves_the_valid_dag_loading"
        ],
    ),
}


def setup_cfg(target: Target) -> str:
    def lines(key: str, values: list[str]) -> str:
        return f"{key} =\n" + "".join(f"    {v}\n" for v in values)

    return (
        "[mutmut]\n"
        + lines("source_paths", ["loraflow", "operators"])
        + lines("only_mutate", target.files)
        + lines("also_copy", ["pipelines", "dags", "docs", "envs"])
        + lines("pytest_add_cli_args_test_selection", target.tests + [f"--deselect={t}" for t in target.deselect])
        + lines("pytest_add_cli_args", ["-p", "no:cacheprovider", "-q"])
    )


def stage(name: str, target: Target) -> Path:
    """A fresh copy of what the tests need; mutmut writes its mutants/ beside it, never in the tree."""
    root = OUT / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_artifacts")
    for item in COPY:
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, root / item, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, root / item)
    (root / "mutants").mkdir()
    (root / "mutants" / ".venvs").symlink_to(REPO / ".venvs")  # the tests run in mutants/ and find the emulator here
    (root / "setup.cfg").write_text(setup_cfg(target))
    return root


# Every mutant's status, and the diff of each survivor, in one process (``mutmut show`` costs a start each).
RESULTS = r"""
import fnmatch, json, sys
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

globs = json.loads(sys.argv[1])
out = {}
for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    for name, code in data.exit_code_by_key.items():
        if globs and not any(fnmatch.fnmatch(name, g) for g in globs):
            continue
        status = status_by_exit_code[code]
        diff = get_diff_for_mutant(name, path=data.path) if status in ("survived", "no tests") else ""
        out[name] = [status, diff]
print(json.dumps(out))
"""


def mutmut(root: Path, target: Target, *args: str, log: Path | None = None) -> str:
    python = REPO / ".venvs" / target.env / "bin" / "python"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if log is not None:  # written as it runs: `tail -f .mutate/<target>/mutmut-run.log` shows the progress
        with log.open("w") as fh:
            subprocess.run([str(python), *args], cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
        return ""
    out = subprocess.run([str(python), *args], cwd=root, env=env, capture_output=True, text=True, check=False)
    return out.stdout


def stop_leftovers(root: Path) -> None:
    """A mutant killed for its time limit leaves what its tests started (a GCS emulator) running:
    end each process of ours still working in this scratch copy, by its id."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = (proc / "cwd").resolve(strict=True)
        except OSError:
            continue
        if cwd.is_relative_to(root.resolve()) and int(proc.name) != os.getpid():
            try:
                os.kill(int(proc.name), signal.SIGTERM)
            except OSError:
                pass


def run(name: str, target: Target) -> dict:
    root = stage(name, target)
    start = time.monotonic()
    mutmut(root, target, "-m", "mutmut", "run", *target.functions, log=root / "mutmut-run.log")
    seconds = time.monotonic() - start
    stop_leftovers(root)
    found = json.loads(mutmut(root, target, "-c", RESULTS, json.dumps(target.functions)).splitlines()[-1])
    counts: dict[str, int] = {}
    survivors = {}
    for mutant, (status, diff) in found.items():
        counts[status] = counts.get(status, 0) + 1
        if diff:
            lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
            survivors[mutant] = (status, lines)
    return {"name": name, "seconds": seconds, "counts": counts, "survivors": survivors, "total": len(found)}


def report(results: list[dict], wall: float) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")  # fmt: skip
    out = [
        f"# make mutate: {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores ({cpu}), {wall / 60:.1f} min",
        "",
        "| target | mutants | killed | timeout | survived | no tests | other | minutes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        c = dict(r["counts"])
        main = [c.pop(k, 0) for k in ("killed", "timeout", "survived", "no tests")]
        other = ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "0"
        out.append(
            f"| {r['name']} | {r['total']} | " + " | ".join(map(str, main)) + f" | {other} | {r['seconds'] / 60:.1f} |"
        )
    for r in results:
        if r["survivors"]:
            out += ["", f"## {r['name']}: surviving mutants", ""]
            for mutant, (status, diff) in r["survivors"].items():
                out += [f"- `{mutant}` ({status})", "  ```diff", *[f"  {ln}" for ln in diff], "  ```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*", help=f"some of {', '.join(TARGETS)} (default: all)")
    args = parser.parse_args(argv)
    names = args.targets or [name for name, target in TARGETS.items() if target.default]
    if unknown := [n for n in names if n not in TARGETS]:
        parser.error(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    OUT.mkdir(exist_ok=True)
    start = time.monotonic()
    results, failed = [], []
    for name in names:
        print(f"mutate {name} ...", flush=True)
        r = run(name, TARGETS[name])
        results.append(r)
        print(f"  {r['total']} mutants, {r['counts']}, {r['seconds'] / 60:.1f} min", flush=True)
        if r["counts"].get("not checked", 0) == r["total"]:
            failed.append(name)
            print(f"  mutmut did not run (its clean test run failed?): see .mutate/{name}/mutmut-run.log", flush=True)
    text = report(results, time.monotonic() - start)
    (OUT / "report.md").write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
