"""The regression guard (gate.guard): its rule, its shipped sets and their format, the spec, the plan, the gate step."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from loraflow.data import chat_template
from loraflow.data.chat_template import ChatTemplate
from loraflow.dev import tinymodel
from loraflow.errors import LoraflowError, SpecError
from loraflow.evaluation import gate_rule, guard, guard_data
from loraflow.evaluation.gate_rule import GateError, paired
from loraflow.models import FAMILIES
from loraflow.pipeline import plan
from loraflow.spec.schema import validate_spec
from loraflow.spec.step_configs import EvaluateConfig, parse
from loraflow.steps import _guard, gate
from tests.chat_cases import LLAMA31_SPECIALS, LLAMA31_TEMPLATE, QWEN3_SPECIALS, QWEN3_TEMPLATE
from tests.spec_defaults import decide, guard_check

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "pipelines" / "tiny-llama-lora.yaml"
# A shipped set never changes under its name (the gate compares base and tuned on it; the registry keeps it).
SHIPPED_SHA256 = {
    "general-mc-v1": "e230efbd31570b5176887f5a9a20d20794af8e50357d93bac29f664a0b21ba88",
    "arithmetic-mc-v1": "dcafcf20a7de327cdd5ad43a6ac98d1ea7edebf986d67101b93bff7c466ffcdc",
}


def outcomes(pattern: str) -> dict[str, bool]:
    return {f"q{i:03d}": c == "1" for i, c in enumerate(pattern)}


# ------------------------------------------------------------------------------------ the rule


def test_a_drop_within_max_drop_passes_and_one_beyond_fails_saying_by_how_much() -> None:
    base = outcomes("1" * 60 + "0" * 40)  # 0.60
    small = guard_check(base, outcomes("1" * 57 + "0" * 43), max_drop=0.05, guard_set="general-mc-v1")
    assert small.passed is True and small.delta == pytest.approx(-0.03) and small.broken == 3 and small.fixed == 0
    assert "accuracy 0.600 -> 0.570 (-0.030) on 100 questions, within the allowed drop of 0.050" in small.reason
    assert small.reason.startswith("guard general-mc-v1: ")
    big = guard_check(base, outcomes("1" * 48 + "0" * 52), max_drop=0.05, guard_set="general-mc-v1")
    assert big.passed is False and big.delta == pytest.approx(-0.12)
    assert "a drop of 0.120, more than the allowed 0.050 (by 0.070)" in big.reason
    assert "12 questions broken, 0 fixed" in big.reason
    record = big.as_dict()  # what decision.json holds under guard
    assert {k: record[k] for k in ("passed", "set", "max_drop", "rule", "n", "confidence", "bootstrap_samples",
                                   "seed")} == {"passed": False, "set": "general-mc-v1", "max_drop": 0.05,
                                                "rule": "estimate", "n": 100, "confidence": 0.95,
                                                "bootstrap_samples": 2000, "seed": 0}  # fmt: skip


def test_a_drop_exactly_at_max_drop_passes() -> None:
    check = guard_check(outcomes("1" * 30 + "0" * 30), outcomes("1" * 27 + "0" * 33), max_drop=0.05)
    assert check.delta == pytest.approx(-0.05) and check.passed  # -3/60 is not exactly -0.05 in floating point
    assert not guard_check(outcomes("1" * 30 + "0" * 30), outcomes("1" * 26 + "0" * 34), max_drop=0.05).passed


def test_a_gain_passes_any_max_drop() -> None:
    check = guard_check(outcomes("0" * 50), outcomes("1" * 10 + "0" * 40), max_drop=0.0)
    assert check.passed and check.delta == pytest.approx(0.2)


def test_the_guard_is_the_gates_paired_bootstrap() -> None:
    """The same interval as the promotion rule computes for the same outcomes and settings."""
    base, tuned = outcomes("0011010011" * 8), outcomes("0111011010" * 8)
    check = guard_check(base, tuned, max_drop=0.1, confidence=0.9, bootstrap_samples=500, seed=3)
    d = decide(base, tuned, confidence=0.9, bootstrap_samples=500, seed=3)
    assert check.ci == d.ci and check.delta == d.delta and (check.fixed, check.broken) == (d.fixed, d.broken)
    assert check.as_dict()["ci"] == list(d.ci)


def test_the_paired_comparison_follows_the_metrics_direction() -> None:
    """Where lower is better (an error rate), the gain is base - tuned and a fall is what promotes."""
    base, tuned = outcomes("1" * 50 + "0" * 50), outcomes("1" * 20 + "0" * 80)
    p = paired(base, tuned, confidence=0.95, bootstrap_samples=200, seed=0, higher_is_better=False)
    assert p.delta == pytest.approx(0.3) and (p.fixed, p.broken) == (30, 0) and p.ci[0] > 0
    d = decide(base, tuned, metric="error_rate", min_improvement=0.2, higher_is_better=False)
    assert d.promote is True and d.reason.startswith("error_rate fell by +0.300 (0.500 -> 0.200)")


def test_the_interval_rule_refuses_a_drop_not_shown_to_be_small() -> None:
    """4 broken, 2 fixed of 40: measured -0.05 within 0.1, but the interval's lower bound is below -0.1."""
    base, tuned = outcomes("1111" + "00" + "0" * 34), outcomes("0000" + "11" + "0" * 34)
    estimate = guard_check(base, tuned, max_drop=0.1)
    interval = guard_check(base, tuned, max_drop=0.1, rule="interval")
    assert estimate.passed and estimate.ci[0] < -0.1
    assert interval.passed is False and "cannot show the drop is small enough" in interval.reason
    assert f"the 95% interval's lower bound {interval.ci[0]:+.3f} allows a drop of {-interval.ci[0]:.3f}" in (
        interval.reason
    )
    # a lower bound exactly at -max_drop passes; one a hair below does not
    at = guard_check(base, tuned, max_drop=-estimate.ci[0], rule="interval")
    assert at.passed is True and "the change and the interval's lower bound within the allowed drop" in at.reason
    assert guard_check(base, tuned, max_drop=-estimate.ci[0] - 1e-6, rule="interval").passed is False
    many = guard_check(outcomes(("1111" + "0" * 36) * 20), outcomes(("0000" + "11" + "0" * 34) * 20), max_drop=0.1,
                       rule="interval")  # fmt: skip
    assert many.passed, many.reason  # the same rates on 800 questions: the interval is narrow enough


def test_the_guard_refuses_unpaired_sets_and_bad_settings() -> None:
    with pytest.raises(GateError, match="different examples"):
        guard_check(outcomes("01"), {"x": True, "y": False}, max_drop=0.1)
    with pytest.raises(GateError, match="unknown guard rule 'strict'; use one of: estimate, interval"):
        guard_check(outcomes("01"), outcomes("01"), max_drop=0.1, rule="strict")
    for bad in (1.5, -0.1):
        with pytest.raises(GateError, match=r"max_drop must lie in \[0, 1\]"):
            guard_check(outcomes("01"), outcomes("01"), max_drop=bad)
    assert guard_check(outcomes("10"), outcomes("01"), max_drop=1.0).passed is True  # both ends allowed


# ------------------------------------------------------------------------------------ shipped sets


@pytest.mark.parametrize("name", list(guard.SHIPPED))
def test_the_shipped_sets_are_what_their_generator_writes_and_never_change(name: str) -> None:
    path = guard.shipped_path(name)
    assert path.read_text() == guard_data.text_of(name), "regenerate: python -m loraflow.evaluation.guard_data"
    assert guard.sha256_of(path) == SHIPPED_SHA256[name], "a changed set needs a new name (-v2)"
    questions = guard.load_questions(path)
    assert len({q.question for q in questions}) == len(questions) >= 100
    assert all(len(q.choices) == 4 for q in questions)
    # the right answer stands in each place equally often: always picking one place scores 25%
    assert set(Counter(q.answer for q in questions).values()) == {len(questions) // 4}


def test_the_arithmetic_answers_are_right() -> None:
    for q in guard.load_questions(guard.shipped_path("arithmetic-mc-v1")):
        numbers = [int(w.strip("?,.")) for w in q.question.split() if w.strip("?,.").isdigit()]
        text = q.question
        a, b = numbers[0], numbers[1]
        if "gets" in text and "loses" in text:
            expected = a + b - numbers[2]
        elif "gets" in text:
            expected = a + b
        elif "gave away" in text:
            expected = a - b
        elif "shares" in text:
            expected = a // b
        else:  # boxes of a, or b items at a dollars
            expected = a * b
        assert q.choices[q.answer] == str(expected), q


def test_a_guard_set_with_bad_rows_is_refused_naming_every_line(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1},
        {"id": "a", "question": "Q2?", "choices": ["x", "y"], "answer": 0},
        {"question": "Q3?", "choices": ["x", "x"], "answer": 0},
        {"question": "Q4?", "choices": ["x", "y"], "answer": 2},
        {"question": "", "choices": ["x", "y"], "answer": 0},
        {"question": "Q6?", "choices": ["x"], "answer": 0},
        {"question": "Q7?", "choices": ["x", "y"], "answer": True},
        {"question": "Q8?", "options": ["x", "y"], "answer": 0},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    with pytest.raises(guard.GuardSetError) as err:
        guard.load_questions(path)
    message = str(err.value)
    for says in ("mine.jsonl:2: id 'a' appears twice", "mine.jsonl:3: two choices are the same", "mine.jsonl:4: 'answer'",
                 "mine.jsonl:5: 'question'", "mine.jsonl:6: 1 choices", "and 3 more"):  # fmt: skip
        assert says in message, message
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(guard.GuardSetError, match="holds no questions"):
        guard.load_questions(tmp_path / "empty.jsonl")
    with (tmp_path / "huge.jsonl").open("wb") as f:
        f.truncate(guard.MAX_SET_BYTES + 1)
    with pytest.raises(guard.GuardSetError, match=r"huge\.jsonl is 16777217 bytes, more than the 16 MiB a guard set may "
                       r"be; a guard set is a few hundred questions: name a smaller file$"):  # fmt: skip
        guard.load_questions(tmp_path / "huge.jsonl")


def test_a_guard_setting_is_a_shipped_name_or_a_gs_uri() -> None:
    assert guard.check_setting("general-mc-v1") == "general-mc-v1"
    assert guard.check_setting("gs://team/guards/mine.jsonl") == "gs://team/guards/mine.jsonl"
    with pytest.raises(ValueError) as err:
        guard.check_setting("GS://team/mine.jsonl")
    assert str(err.value) == (
        "'GS://team/mine.jsonl' is neither a shipped guard set (general-mc-v1, arithmetic-mc-v1) nor a gs:// URI of "
        "a JSONL file of {id, question, choices, answer} rows; name one of those"
    )
    with pytest.raises(
        guard.GuardSetError, match=r"^no shipped guard set 'mmlu'; shipped: general-mc-v1, arithmetic-mc-v1$"
    ):
        guard.shipped_path("mmlu")


def test_a_guard_set_row_is_checked_rule_by_rule(tmp_path: Path) -> None:
    row = {"question": "Q?", "choices": ["x", "y"], "answer": 0}

    def refusal(bad: dict) -> str:
        (tmp_path / "one.jsonl").write_text(json.dumps(bad) + "\n")
        with pytest.raises(guard.GuardSetError) as err:
            guard.load_questions(tmp_path / "one.jsonl")
        return str(err.value).split(". A row is")[0]

    assert refusal({**row, "options": ["x"]}) == "guard set one.jsonl: one.jsonl:1: unknown key(s) ['options']"
    for choices in ("xy", ["x", " "], ["x", 3]):
        assert refusal({**row, "choices": choices}).endswith(": 'choices' must be a list of non-blank strings")
    assert refusal({**row, "choices": [str(i) for i in range(11)]}).endswith(": 11 choices; give 2 to 10")
    assert refusal({**row, "answer": 2}).endswith(": 'answer' must be the index of the right choice, 0 to 1 (got 2)")
    ten = {**row, "choices": [str(i) for i in range(10)], "answer": 9}
    (tmp_path / "ok.jsonl").write_text(json.dumps(ten) + "\n\n" + json.dumps({**row, "id": "b"}) + "\n")
    assert [(q.id, len(q.choices)) for q in guard.load_questions(tmp_path / "ok.jsonl")] == [("0", 10), ("b", 2)]
    with (tmp_path / "exact.jsonl").open("wb") as f:  # the largest file allowed is read
        f.write(b"\n" * guard.MAX_SET_BYTES)
    with pytest.raises(guard.GuardSetError, match=r"exact\.jsonl holds no questions"):
        guard.load_questions(tmp_path / "exact.jsonl")


@pytest.mark.parametrize(("rows", "more"), [(5, ""), (6, "; and 1 more")])
def test_a_refusal_shows_the_first_five_problems_and_counts_the_rest(rows: int, more: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text((json.dumps({"question": " ", "choices": ["x", "y"], "answer": 0}) + "\n") * rows)
    with pytest.raises(guard.GuardSetError) as err:
        guard.load_questions(path)
    shown = "; ".join(f"bad.jsonl:{i}: 'question' must be a non-blank string" for i in range(1, 6))
    assert str(err.value) == (
        f'guard set bad.jsonl: {shown}{more}. A row is {{"id", "question", "choices": [2-10 options], '
        '"answer": index of the right option}'
    )


def test_scores_are_per_byte_and_ties_go_to_the_first_option() -> None:
    assert guard.option_score([-1.0, -2.0], "abc") == pytest.approx(-1.0)
    assert guard.option_score([-1.0], "é") == pytest.approx(-0.5)  # two UTF-8 bytes
    assert guard.option_score([-1.0], "x") == pytest.approx(-1.0)
    assert guard.choose([-1.0, -0.5, -0.5]) == 1 and guard.choose([-2.0, -3.0]) == 0
    q = [guard.Question("a", "Q?", ("x", "y"), 1), guard.Question("b", "R?", ("x", "y"), 1)]
    scored = guard.result("s", "0" * 64, q, [[-1.0, -0.5], [-0.5, -0.5]])
    assert scored.chosen == [1, 0] and scored.correct == [True, False] and scored.accuracy == 0.5
    assert scored.summary()["n_correct"] == 1 and scored.rows(q)[1]["chosen"] == 0


def test_the_option_is_what_the_template_writes_where_it_writes_the_answer() -> None:
    mark = guard.ANSWER_MARK
    assert guard.continuation("Mercury<|end|>\n", f"{mark}<|end|>\n", "Mercury") == "Mercury"
    assert guard.continuation(" Mercury</s>", f" {mark}</s>", "Mercury") == " Mercury"
    # the option's text inside the template's own (Qwen3's think block, the end-of-turn token) is not the answer
    think = "<think>\n\n</think>\n\n"
    assert guard.continuation(f"{think}thin<|im_end|>\n", f"{think}{mark}<|im_end|>\n", "thin") == f"{think}thin"
    assert guard.continuation("end<|end|>\n", f"{mark}<|end|>\n", "end") == "end"
    assert guard.continuation("x<|end|><|end|>\n", f"{mark}<|end|>\n", "x<|end|>") == "x<|end|>"
    assert guard.continuation("Mercury", mark, "Mercury") == "Mercury"  # nothing after the answer
    assert guard.continuation("mercury.", f"{mark}.", "Mercury") == "mercury"  # as the template writes it
    with pytest.raises(guard.GuardSetError, match=r"does not write the assistant's answer once, as given .*: use a "
                       r"template that writes the assistant's content as it is given$"):  # fmt: skip
        guard.continuation("Mercury", "ANSWER", "Mercury")  # a template that drops or rewrites the content
    with pytest.raises(guard.GuardSetError, match="does not write the assistant's answer once, as given"):
        guard.continuation("Mercury Mercury", f"{mark} {mark}", "Mercury")
    for piece in ("<b>Mercury<|end|>", "<a>Mercury</a>", "<a><|end|>", "<a"):  # not between <a> and <|end|>
        with pytest.raises(guard.GuardSetError, match=r"writes the answer 'Mercury' as .*not between '<a>' and"):
            guard.continuation(piece, f"<a>{mark}<|end|>", "Mercury")
    with pytest.raises(guard.GuardSetError, match=r"so its text cannot be told from the template's: reword the option, "
                       r"or use a template that writes every answer the same way$"):  # fmt: skip
        guard.continuation("<a>", f"<a>{mark}a>", "Mercury")  # the text around it overlaps: nothing is the option's
    for shown, marked in (("y" * 60, "y" * 60), ("y" * 60 + "...", "y" * 61)):  # a long piece is shown cut
        with pytest.raises(guard.GuardSetError) as err:
            guard.continuation("o", marked, "o")
        assert f"it writes {shown!r});" in str(err.value)


def test_each_option_is_tokenised_after_its_questions_prompt() -> None:
    questions = [guard.Question("a", "Q?", ("x", "yz"), 0)]
    seqs = guard.token_sequences(questions, [[1, 2]], lambda q: list(q.choices), lambda t: [ord(c) for c in t])
    assert seqs == [([1, 2, ord("x")], 2), ([1, 2, ord("y"), ord("z")], 2)]
    with pytest.raises(ValueError):  # a prompt for every question
        guard.token_sequences(questions * 2, [[1, 2]], lambda q: list(q.choices), lambda t: [ord(c) for c in t])
    with pytest.raises(guard.GuardSetError, match=r"^guard question 'a': an option tokenises to nothing$"):
        guard.token_sequences(questions, [[1, 2]], lambda q: list(q.choices), lambda t: [])


def test_a_guard_result_records_its_set_and_every_question() -> None:
    """metrics.json's guard (the gate compares its set and sha256) and guard_predictions.jsonl's rows."""
    q = [guard.Question("a", "Q?", ("x", "y"), 1), guard.Question("b", "R?", ("x", "y"), 0)]
    scored = guard.result("mine", "ab" * 32, q, [[-1.23456789, -0.5], [-0.5, -0.25]])
    assert scored.summary() == {"set": "mine", "sha256": "ab" * 32, "n": 2, "accuracy": 0.5, "n_correct": 1,
                                "ids": ["a", "b"], "correct": [True, False]}  # fmt: skip
    assert scored.rows(q) == [
        {"id": "a", "question": "Q?", "choices": ["x", "y"], "answer": 1, "chosen": 1, "correct": True,
         "scores": [-1.234568, -0.5]},
        {"id": "b", "question": "R?", "choices": ["x", "y"], "answer": 0, "chosen": 1, "correct": False,
         "scores": [-0.5, -0.25]},
    ]  # fmt: skip
    with pytest.raises(ValueError):  # rows of other questions than were scored
        scored.rows(q[:1])
    with pytest.raises(ValueError):  # a list of scores per question
        guard.result("mine", "ab" * 32, q, [[-1.0, -0.5]])


def _tiny(chat: tinymodel.ChatFormat, origin: str) -> ChatTemplate:
    return ChatTemplate(
        "inline", origin, chat.template, {"bos_token": chat.bos, "eos_token": chat.eos, "pad_token": chat.pad}
    )


# What each family's chat template (the instruct tokenizer's own, tests/chat_cases.py; Gemma 3's and the
# tiny model's as loraflow/dev/tinymodel.py writes them) writes in the answer before the assistant's content.
FAMILY_TEMPLATES = {
    "llama": (ChatTemplate("inline", "Llama 3.1 Instruct", LLAMA31_TEMPLATE, LLAMA31_SPECIALS), ""),
    "qwen3": (ChatTemplate("inline", "Qwen3", QWEN3_TEMPLATE, QWEN3_SPECIALS), "<think>\n\n</think>\n\n"),
    "gemma3": (_tiny(tinymodel.GEMMA3_CHAT, "Gemma 3"), ""),
    "tiny": (_tiny(tinymodel.CHAT, "the tiny model's"), ""),
    "none": (
        ChatTemplate("none", "plain text", chat_template.PLAIN_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}),
        "",
    ),
}


def test_every_model_family_has_its_template_here() -> None:
    assert {f.name for f in FAMILIES} <= set(FAMILY_TEMPLATES)


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
@pytest.mark.parametrize("name", list(guard.SHIPPED))
def test_each_option_of_the_shipped_sets_is_scored_as_exactly_its_text(family: str, name: str) -> None:
    """Through each family's real template: what follows the prompt is the template's text before an answer,
    then the option, and nothing else (Qwen3's option "thin" is "thin", not the "<thin" of "<think>")."""
    template, before = FAMILY_TEMPLATES[family]
    for q in guard.load_questions(guard.shipped_path(name)):
        assert _guard.continuations(template, q) == [before + option for option in q.choices], q.id


def test_a_template_that_does_not_write_the_answer_as_given_is_refused() -> None:
    q = guard.Question("q", "Which?", ("Venus", "Mars"), 0)
    upper = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(guard.GuardSetError, match="does not write the assistant's answer once, as given"):
        _guard.continuations(ChatTemplate("inline", "upper", upper), q)
    # Qwen3 writes the reasoning of an answer holding "<think>...</think>" inside its think block: the option's
    # text no longer stands where the template writes answers
    qwen3 = FAMILY_TEMPLATES["qwen3"][0]
    with pytest.raises(guard.GuardSetError, match=r"writes the answer '<think>hm</think>Mars' as '<think>\\nhm\\n"):
        _guard.continuations(qwen3, guard.Question("q", "Which?", ("Venus", "<think>hm</think>Mars"), 0))


# ------------------------------------------------------------------------------------ spec and plan


def _spec(guard_section: object) -> dict:
    data = yaml.safe_load(TINY.read_text())
    data["gate"]["guard"] = guard_section
    return data


def test_the_spec_refuses_a_bad_guard_naming_each_problem_and_the_fix() -> None:
    with pytest.raises(SpecError) as err:
        validate_spec(_spec({"set": "mmlu", "max_drop": 2, "rule": "strict", "sets": 1}), "s.yaml")
    message = str(err.value)
    assert "gate.guard.set" in message and "general-mc-v1, arithmetic-mc-v1" in message and "gs:// URI" in message
    assert "gate.guard.max_drop: is a share of the questions, 0 to 1, not points: write 0.02 for 2 points" in message
    assert "gate.guard.rule" in message and "gate.guard.sets" in message
    with pytest.raises(SpecError, match=r"gate\.guard\.set: .*has an empty or '\.' path segment"):
        validate_spec(_spec({"set": "gs://bucket//x.jsonl"}), "s.yaml")
    with pytest.raises(SpecError, match=r"gate\.guard: name either set \(a guard set\) or suite"):
        validate_spec(_spec({"max_drop": 0.1}), "s.yaml")


def test_without_a_guard_the_evaluations_are_planned_as_before() -> None:
    data = yaml.safe_load(TINY.read_text())
    data["gate"].pop("guard", None)
    plans = plan.stage_plans(validate_spec(data, "s.yaml"))
    for stage in ("evaluate_base", "evaluate_tuned"):
        assert "guard_set" not in plans[stage].config  # so their cache keys stay what they were
        assert set(plans[stage].inputs) == {"model", "eval_set"}
    assert "guard" not in plans["gate"].config or plans["gate"].config["guard"] is None


def test_a_shipped_guard_is_sent_by_name_and_a_users_own_as_an_input() -> None:
    shipped = plan.stage_plans(validate_spec(_spec({"set": "arithmetic-mc-v1", "max_drop": 0.1}), "s.yaml"))
    for stage in ("evaluate_base", "evaluate_tuned"):
        assert shipped[stage].config["guard_set"] == "arithmetic-mc-v1" and "guard_set" not in shipped[stage].inputs
    assert shipped["gate"].config["guard"] == {"set": "arithmetic-mc-v1", "max_drop": 0.1, "rule": "estimate"}
    own = plan.stage_plans(validate_spec(_spec({"set": "gs://team/guards/mine.jsonl"}), "s.yaml"))
    for stage in ("evaluate_base", "evaluate_tuned"):
        assert own[stage].config["guard_set"] == "gs://team/guards/mine.jsonl"
        assert own[stage].inputs["guard_set"] == plan.Source("gs://team/guards/mine.jsonl")


def _evaluate_config(guard_section: object) -> EvaluateConfig:
    plans = plan.stage_plans(validate_spec(_spec(guard_section), "s.yaml"))
    return parse(EvaluateConfig, plans["evaluate_base"].config)


def test_the_evaluate_step_reads_the_guard_set_its_config_names(tmp_path: Path) -> None:
    assert _guard.load(_evaluate_config(None), {}) is None
    shipped = _guard.load(_evaluate_config({"set": "arithmetic-mc-v1"}), {})
    assert shipped is not None and shipped.name == "arithmetic-mc-v1"
    assert shipped.path == guard.shipped_path("arithmetic-mc-v1") and len(shipped.questions) == 120
    own_config = _evaluate_config({"set": "gs://team/guards/mine.jsonl"})
    with pytest.raises(LoraflowError, match=r"guard_set 'gs://team/guards/mine\.jsonl' is not a shipped set, so it "
                       r"must come as --input guard_set=gs://\.\.\.; the planner sends it for a gs:// gate\.guard\.set "
                       r"\(shipped: general-mc-v1, arithmetic-mc-v1\)$"):  # fmt: skip
        _guard.load(own_config, {})
    folder = tmp_path / "guard_set" / "nested"
    folder.mkdir(parents=True)
    (folder / "mine.jsonl").write_text(json.dumps({"question": "Q?", "choices": ["a", "b"], "answer": 1}) + "\n")
    own = _guard.load(own_config, {"guard_set": tmp_path / "guard_set"})
    assert own is not None and own.name == "gs://team/guards/mine.jsonl" and own.path == folder / "mine.jsonl"
    assert own.questions == [guard.Question("0", "Q?", ("a", "b"), 1)]


def test_a_guard_set_input_is_one_jsonl_file(tmp_path: Path) -> None:
    (tmp_path / "one.jsonl").write_text("{}")
    assert guard.find_set_file(tmp_path / "one.jsonl") == tmp_path / "one.jsonl"  # the input itself
    assert guard.find_set_file(tmp_path) == tmp_path / "one.jsonl"
    (tmp_path / "two.jsonl").write_text("{}")
    with pytest.raises(guard.GuardSetError, match=r"must be one JSONL file; found \[.*one\.jsonl.*two\.jsonl"):
        guard.find_set_file(tmp_path)
    with pytest.raises(guard.GuardSetError, match=r"must be one JSONL file; found \[\]"):
        guard.find_set_file(tmp_path / "empty")


# ------------------------------------------------------------------------------------ the gate step


def write_eval(d: Path, pattern: str, guard_pattern: str | None, guard_set: str = "general-mc-v1") -> Path:
    """An evaluate-shaped directory: predictions, metrics.json and (with guard_pattern) the guard's file."""
    import pandas as pd

    d.mkdir(parents=True)
    ids = [f"eval-{i:04d}" for i in range(len(pattern))]
    correct = [c == "1" for c in pattern]
    pd.DataFrame({"id": ids, "correct": correct, "generation": [f"g{c}" for c in correct]}).to_parquet(
        d / "predictions.parquet"
    )
    metrics: dict = {"accuracy": sum(correct) / len(correct), "n": len(pattern)}
    if guard_pattern is not None:
        rows = [{"id": f"general-mc-{i:03d}", "correct": c == "1", "chosen": 0} for i, c in enumerate(guard_pattern)]
        (d / guard.PREDICTIONS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        metrics["guard"] = {"set": guard_set, "sha256": SHIPPED_SHA256.get(guard_set, "f" * 64), "n": len(rows)}
    (d / "metrics.json").write_text(json.dumps(metrics))
    return d


GUARDED = {"min_improvement": 0.3, "guard": {"set": "general-mc-v1", "max_drop": 0.05}}


def test_a_failed_guard_refuses_a_model_the_task_metric_would_promote(tmp_path: Path, make_ctx: Callable) -> None:
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20, "1" * 60 + "0" * 40),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5, "1" * 45 + "0" * 55),
    }
    ctx = make_ctx("gate", inputs, GUARDED)
    summary = gate.run(ctx)
    assert summary["promote"] is False and summary["guard"] == {"passed": False, "delta": pytest.approx(-0.15)}
    decision = json.loads((ctx.out / "decision.json").read_text())
    assert decision["delta"] == pytest.approx(0.75)  # the task metric's evidence stays
    assert decision["guard"]["passed"] is False and decision["guard"]["n"] == 100
    assert decision["guard"]["base"] == pytest.approx(0.6) and decision["guard"]["tuned"] == pytest.approx(0.45)
    assert "but the regression guard failed: guard general-mc-v1" in decision["reason"]
    assert "more than the allowed 0.050 (by 0.100)" in decision["reason"]


def test_a_passed_guard_lets_the_model_through_and_both_checks_are_shown(tmp_path: Path, make_ctx: Callable) -> None:
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20, "1" * 60 + "0" * 40),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5, "1" * 58 + "0" * 42),
    }
    ctx = make_ctx("gate", inputs, GUARDED)
    assert gate.run(ctx)["promote"] is True
    decision = json.loads((ctx.out / "decision.json").read_text())
    assert decision["guard"]["passed"] is True and "accuracy rose by +0.750" in decision["reason"]
    assert "guard general-mc-v1 (sha256 e230efbd3157): accuracy 0.600 -> 0.580" in decision["reason"]


def test_the_gate_refuses_evaluations_without_the_guard_or_of_another_set(tmp_path: Path, make_ctx: Callable) -> None:
    base = write_eval(tmp_path / "b", "01" * 50, "1" * 10)
    none = write_eval(tmp_path / "t", "11" * 50, None)
    with pytest.raises(GateError, match=r"^tuned_eval: the evaluation scored no guard set \(no guard_predictions\.jsonl\), "
                       r"but gate\.guard asks for one; re-run its evaluate stage with this spec \(gate\.guard\.set is "
                       r"part of its cache key\)$"):  # fmt: skip
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": none}, GUARDED))
    with pytest.raises(GateError, match=r"^base_eval: the evaluation scored no guard set"):
        gate.run(make_ctx("gate", {"base_eval": none, "tuned_eval": base}, GUARDED))
    listed = _rewrite_guard(write_eval(tmp_path / "l", "11" * 50, "1" * 10))
    metrics = json.loads((listed / "metrics.json").read_text())
    (listed / "metrics.json").write_text(json.dumps({**metrics, "guard": ["general-mc-v1"]}))
    with pytest.raises(GateError, match=r"^tuned_eval: the evaluation scored no guard set"):
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": listed}, GUARDED))
    other = write_eval(tmp_path / "o", "11" * 50, "1" * 10, guard_set="arithmetic-mc-v1")
    with pytest.raises(GateError, match="the evaluations scored different guard sets"):
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": other}, GUARDED))
    # without gate.guard the guard files are not read
    unguarded = make_ctx("gate", {"base_eval": base, "tuned_eval": write_eval(tmp_path / "u", "11" * 50, None)}, {})
    assert "guard" not in gate.run(unguarded)


def test_the_gate_step_applies_the_interval_rule_with_the_gates_settings(tmp_path: Path, make_ctx: Callable) -> None:
    """gate.guard.rule: interval reaches the step: a drop the estimate allows but the interval cannot show small
    refuses promotion, and the check is the one gate_rule computes with the spec's confidence, samples and seed."""
    base_guard, tuned_guard = "1111" + "00" + "0" * 34, "0000" + "11" + "0" * 34  # -0.05, a wide interval
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20, base_guard),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5, tuned_guard),
    }
    settings = {"min_improvement": 0.3, "confidence": 0.9, "bootstrap_samples": 500, "seed": 3}
    guard_section = {"set": "general-mc-v1", "max_drop": 0.1}
    estimate = gate.run(make_ctx("gate", inputs, {**settings, "guard": guard_section}))
    assert estimate["promote"] is True and estimate["guard"]["passed"] is True
    ctx = make_ctx("gate", inputs, {**settings, "guard": {**guard_section, "rule": "interval"}})
    summary = gate.run(ctx)
    assert summary["promote"] is False and summary["guard"] == {"passed": False, "delta": pytest.approx(-0.05)}
    decision = json.loads((ctx.out / "decision.json").read_text())
    ids = [f"general-mc-{i:03d}" for i in range(40)]
    expected = gate_rule.guard_check(
        {q: c == "1" for q, c in zip(ids, base_guard, strict=True)},
        {q: c == "1" for q, c in zip(ids, tuned_guard, strict=True)},
        max_drop=0.1,
        rule="interval",
        guard_set=f"general-mc-v1 (sha256 {SHIPPED_SHA256['general-mc-v1'][:12]})",
        confidence=0.9,
        bootstrap_samples=500,
        seed=3,
    )
    assert decision["guard"] == json.loads(json.dumps(expected.as_dict()))
    assert decision["guard"]["rule"] == "interval" and decision["guard"]["confidence"] == 0.9
    assert "the guard cannot show the drop is small enough" in decision["reason"]


def _rewrite_guard(d: Path, rows: list[str] | None = None, **recorded: object) -> Path:
    """An evaluation's guard predictions replaced by ``rows`` (lines) and its metrics.json ``guard`` updated."""
    if rows is not None:
        (d / guard.PREDICTIONS_FILE).write_text("".join(f"{r}\n" for r in rows))
    metrics = json.loads((d / "metrics.json").read_text())
    metrics["guard"].update(recorded)
    (d / "metrics.json").write_text(json.dumps(metrics))
    return d


def test_the_gate_refuses_guard_results_of_one_name_but_different_contents(tmp_path: Path, make_ctx: Callable) -> None:
    """The same set name with another sha256 (a user's set edited in place between the evaluations) is not the
    same set: the two accuracies would not be comparable."""
    base = write_eval(tmp_path / "b", "0" * 80 + "1" * 20, "1" * 10)
    tuned = _rewrite_guard(write_eval(tmp_path / "t", "1" * 95 + "0" * 5, "1" * 10), sha256="0" * 64)
    with pytest.raises(GateError, match=r"different guard sets \(base general-mc-v1 sha256 e230efbd3157, tuned "
                       r"general-mc-v1 sha256 000000000000; gate\.guard\.set is general-mc-v1\); re-run both "
                       r"evaluations with this spec"):  # fmt: skip
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": tuned}, GUARDED))
    # and the other way round: another name on the same contents
    renamed = _rewrite_guard(write_eval(tmp_path / "r", "1" * 95 + "0" * 5, "1" * 10), set="arithmetic-mc-v1")
    with pytest.raises(GateError, match=r"tuned arithmetic-mc-v1 sha256 e230efbd3157;"):
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": renamed}, GUARDED))
    both = _rewrite_guard(write_eval(tmp_path / "b2", "0" * 80 + "1" * 20, "1" * 10), sha256="0" * 64)
    assert gate.run(make_ctx("gate", {"base_eval": both, "tuned_eval": tuned}, GUARDED))["guard"]["passed"]


def test_the_gate_refuses_guard_predictions_listing_a_question_twice(tmp_path: Path, make_ctx: Callable) -> None:
    base = write_eval(tmp_path / "b", "0" * 80 + "1" * 20, "1" * 10)
    rows = [json.dumps({"id": f"general-mc-{i:03d}", "correct": True}) for i in (0, 1, 2, 1)]
    tuned = _rewrite_guard(write_eval(tmp_path / "t", "1" * 95 + "0" * 5, "1" * 10), rows)
    with pytest.raises(GateError, match=r"tuned_eval: guard_predictions\.jsonl lists question 'general-mc-001' twice"):
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": tuned}, GUARDED))


NOT_A_PREDICTION = 'is not a guard prediction: it needs "id" (a string) and "correct" (true or false)'


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (b'{"id": "general-mc-001", "correct": "false"}', NOT_A_PREDICTION),  # "false" used to count as correct
        (b'{"id": "general-mc-001"}', NOT_A_PREDICTION),
        (b'{"id": 1, "correct": true}', NOT_A_PREDICTION),
        (b"[]", "is not a JSON object (it holds a list)"),
        (b"not json", "is not JSON (Expecting value"),
        (b"[" * 100_000, "is not JSON loraflow reads (nested deeper than 64 levels)"),
        (b'{"id": "general-mc-001\xff", "correct": true}', "is not JSON (not UTF-8: byte 0xff"),
    ],
    ids=["string-correct", "no-correct", "number-id", "list", "not-json", "nested-deep", "not-utf8"],
)
def test_the_gate_refuses_a_guard_prediction_row_it_cannot_read(
    bad: bytes, says: str, tmp_path: Path, make_ctx: Callable
) -> None:
    """One line naming the evaluation, the file and the line, never a traceback or a guess."""
    base = write_eval(tmp_path / "b", "0" * 80 + "1" * 20, "1" * 3)
    tuned = write_eval(tmp_path / "t", "1" * 95 + "0" * 5, "1" * 3)
    rows = [json.dumps({"id": f"general-mc-{i:03d}", "correct": True}).encode() for i in (0, 2)]
    (tuned / guard.PREDICTIONS_FILE).write_bytes(b"\n".join([rows[0], bad, rows[1]]) + b"\n")
    with pytest.raises(GateError) as err:
        gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": tuned}, GUARDED))
    message = str(err.value)
    assert message.startswith(f"tuned_eval: guard_predictions.jsonl line 2 {says}"), message
    assert message.endswith("; re-run its evaluate stage") and len(message) < 400
