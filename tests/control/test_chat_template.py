"""loraflow.data.chat_template: one renderer for training and evaluation, resolved from the spec's
data.chat_template, sandboxed, and refusing templates that would make train and eval prompts differ.

Rendering equality of training pieces and evaluation prompts is checked here on text; the token ids
through MaxText's own SFT data pipeline are checked in tests/trainer/test_chat_template_training.py,
and through vLLM in tests/serving/test_evaluate.py.
"""

from __future__ import annotations

import contextlib
import json
import locale
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from loraflow.data import chat_template as ct
from loraflow.data import template_sandbox
from loraflow.dev.tinymodel import CHAT_TEMPLATE as TINY_TEMPLATE
from loraflow.errors import DataValidationError
from loraflow.spec.schema import DataSpec
from loraflow.steps import validate_data
from tests import chat_cases
from tests.chat_cases import (
    CHAT_WITH_SYSTEM,
    CHATML,
    MULTI_TURN,
    PROMPT_COMPLETION,
    QWEN3_SPECIALS,
    QWEN3_TEMPLATE,
    RECORDS,
)

REPO = Path(__file__).resolve().parents[2]
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|end|>"}
ROWS = RECORDS


def template(source: str, setting: str = "inline") -> ct.ChatTemplate:
    return ct.ChatTemplate(setting, "test", source, SPECIALS)


def normalised(record: dict) -> list[dict]:
    return chat_cases.normalised(record)["messages"]


def tokenizer_dir(root: Path, config: dict, files: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# ------------------------------------------------------------------------------ train == eval


@pytest.mark.parametrize("source", [TINY_TEMPLATE, CHATML, ct.PLAIN_TEMPLATE], ids=["tiny", "chatml", "none"])
@pytest.mark.parametrize("record", ROWS, ids=[r["id"] for r in ROWS])
def test_training_pieces_hold_exactly_the_prompt_evaluation_renders(source: str, record: dict) -> None:
    """For every answer the training text holds, the text before it is the prompt evaluation sends for
    that turn (pieces cut at the same places), and the pieces put together are the whole conversation."""
    t = template(source)
    messages = normalised(record)
    pieces = ct.pieces(t, messages)
    assert "".join(text for text, _ in pieces) == ct.render(t, messages, add_generation_prompt=False)
    assert [is_prompt for _, is_prompt in pieces] == [True, False] * (len(pieces) // 2)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k, turn in enumerate(answers):
        eval_pieces = ct.prompt_pieces(t, messages[:turn])
        assert eval_pieces == [text for text, _ in pieces[: 2 * k + 1]]
        assert ct.render_prompt(t, messages[:turn]) == ct.render(t, messages[:turn], add_generation_prompt=True)
        assert messages[turn]["content"] in pieces[2 * k + 1][0]  # the answer piece holds the answer


def test_the_tiny_template_renders_the_special_tokens_and_the_generation_prompt() -> None:
    t = template(TINY_TEMPLATE)
    pieces = ct.pieces(t, normalised(CHAT_WITH_SYSTEM))
    assert pieces == [
        ("<|bos|><|system|>Answer with a number.\n<|user|>What is 4+4?\n<|assistant|>", True),
        ("8<|end|>", False),
    ]


def test_plain_text_is_the_turns_as_written_with_bos_and_eos() -> None:
    t = template(ct.PLAIN_TEMPLATE)
    assert ct.pieces(t, normalised(PROMPT_COMPLETION)) == [("<|bos|>What is 2+3?", True), ("5<|end|>", False)]
    assert ct.render_prompt(t, [{"role": "user", "content": "Q: 1+1 ="}]) == "<|bos|>Q: 1+1 ="


# ---------------------------------------------------------------------------- refused templates


# What a refusal of a template whose generation prompt adds nothing says after the header it found.
NO_GENERATION_PROMPT = (
    "but not as its generation prompt (add_generation_prompt adds nothing): at evaluation the model would have "
    "to write its own turn header; give a template whose add_generation_prompt branch writes it"
)


def test_a_template_without_a_generation_prompt_is_refused() -> None:
    """ChatML without its add_generation_prompt branch: the model would have to write its own turn header."""
    no_generation = CHATML.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "")
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.pieces(template(no_generation), normalised(PROMPT_COMPLETION))
    assert str(info.value) == (
        f"the chat template writes '<|im_start|>assistant\\n' before the assistant's answer in turn 1 {NO_GENERATION_PROMPT}"
    )


def test_without_a_generation_prompt_even_a_one_character_header_is_refused() -> None:
    marked = "{% for m in messages %}{% if m.role == 'assistant' %}>{% endif %}{{ m.content }}\n{% endfor %}"
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.pieces(template(marked), normalised(MULTI_TURN))
    assert (
        str(info.value)
        == f"the chat template writes '>' before the assistant's answer in turn 1 {NO_GENERATION_PROMPT}"
    )


UPPER = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}{% endfor %}"
SPACED = "{% for m in messages %}{% if m.role == 'assistant' %}{{ ' ' }}{% endif %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize(
    ("source", "messages", "expected"),
    [
        # the answer is also inside the EOS token: it is found where it begins, not in the EOS
        (ct.PLAIN_TEMPLATE, [("user", "The opposite of start:"), ("assistant", "end")], "end<|end|>"),
        # an answer without content (null or no key): nothing before it
        (ct.PLAIN_TEMPLATE, [("user", "Q"), ("assistant", None)], "<|end|>"),
        # the template changes the answer's text: no header can be told apart, none is claimed
        (UPPER, [("user", "Say yes: "), ("assistant", "yes")], "YES"),
        # only whitespace before the answer
        (SPACED, [("user", "Q"), ("assistant", "A")], " A"),
    ],
    ids=["answer-in-eos", "no-content", "changed-answer", "whitespace"],
)
def test_without_a_generation_prompt_only_text_before_the_answer_is_a_header(
    source: str, messages: list[tuple[str, str | None]], expected: str
) -> None:
    turns = [
        {"role": role, "content": content} if content is not None else {"role": role} for role, content in messages
    ]
    assert ct.pieces(template(source), turns)[1] == (expected, False)


def test_a_think_block_after_the_generation_prompt_is_part_of_the_answer() -> None:
    """Qwen3 writes an empty think block after its generation prompt: text the model learns to write, not a turn
    header (only a template whose generation prompt adds nothing is searched for one)."""
    qwen3 = ct.ChatTemplate("inline", "test", QWEN3_TEMPLATE, QWEN3_SPECIALS)
    assert ct.pieces(qwen3, normalised(PROMPT_COMPLETION)) == [
        ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n", True),
        ("<think>\n\n</think>\n\n5<|im_end|>\n", False),
    ]


def test_a_generation_prompt_that_does_not_begin_the_answer_turn_is_refused() -> None:
    odd = CHATML.replace("<|im_start|>assistant\n{% endif %}", "<|im_start|>model\n{% endif %}")
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.pieces(template(odd), normalised(PROMPT_COMPLETION))
    assert str(info.value) == (
        "the chat template's generation prompt '...>\\n<|im_start|>user\\nWhat is 2+3?<|im_end|>\\n<|im_start|>model\\n' "
        "is not how it begins the assistant's turn 1 ('<|im_start|>system\\nYou are helpful.<|im_end|>\\n<|im_start|>us...'); "
        "evaluation would prompt the model differently from training: fix the template's add_generation_prompt branch"
    )


def test_a_template_that_rewrites_history_is_refused() -> None:
    """A template rendering an earlier answer differently once later turns follow (as templates that drop
    earlier reasoning do): the prompt training sees for the second answer is not evaluation's."""
    rewrites = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[old]{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.pieces(template(rewrites), normalised(MULTI_TURN))
    assert str(info.value) == (
        "the chat template renders the turns before turn 3 differently once turn 3 follows "
        "(before: '<user>What is 1+1?\\n<assistant>2\\n'; after: '<user>What is 1+1?\\n[old]<assista'); training and "
        "evaluation would see different prompts: keep one answer per row or use a template that keeps history as written"
    )
    # the eval prompt of the second question: its first answer is rendered otherwise than training cut it
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.prompt_pieces(template(rewrites), normalised(MULTI_TURN)[:3])
    assert str(info.value) == (
        "the chat template renders the earlier turns of this prompt differently once the last turn follows; "
        "training and evaluation would see different prompts: use a template that keeps history as written"
    )


def test_a_conversation_without_an_answer_has_nothing_to_train_on() -> None:
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.pieces(template(TINY_TEMPLATE), [{"role": "user", "content": "hi"}])
    assert str(info.value) == "the conversation has no assistant turn: nothing to train on; add the answer"


def test_a_turn_without_content_renders_as_empty() -> None:
    """OpenAI-style data writes ``"content": null`` (or leaves it out) on a turn that only calls a tool."""
    turns = [{"role": "user", "content": None}, {"role": "user"}, {"role": "user", "content": 7}]
    assert ct.render(template(ct.PLAIN_TEMPLATE), turns, add_generation_prompt=True) == "<|bos|>7"


@pytest.mark.parametrize(
    ("text", "head", "tail"),
    [("x" * 60, "x" * 60, "x" * 60), ("a" + "x" * 59 + "z", "a" + "x" * 59 + "...", "..." + "x" * 59 + "z")],
)
def test_a_refusal_quotes_at_most_60_characters_of_a_piece(text: str, head: str, tail: str) -> None:
    assert (ct._head(text), ct._tail(text)) == (head, tail)


def test_raise_exception_in_a_template_names_its_message() -> None:
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + CHATML
    with pytest.raises(ct.ChatTemplateError, match="refused the conversation: no system turns") as info:
        ct.pieces(template(strict), normalised(CHAT_WITH_SYSTEM))
    # not a broken bound (TemplateBoundError): validate_data goes on and names every row the template refuses
    assert type(info.value) is ct.ChatTemplateError


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_templates_run_sandboxed(hostile: str) -> None:
    """A hostile spec or tokenizer reaches no Python internals and changes nothing it is given."""
    messages = normalised(PROMPT_COMPLETION)
    with pytest.raises(ct.ChatTemplateError):
        ct.render(template(hostile), messages, add_generation_prompt=True)
    assert messages == normalised(PROMPT_COMPLETION)


def test_a_template_that_writes_without_end_is_stopped() -> None:
    """A template looping over large ranges is stopped at MAX_RENDER_CHARS instead of filling the worker's memory."""
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}"
    with pytest.raises(ct.ChatTemplateError, match="more than 4194304 characters"):
        ct.render(template(loops), normalised(PROMPT_COMPLETION), add_generation_prompt=True)


# Templates that hold whoever compiles or renders them, each with the words its refusal says.
BOMBS = {
    "power": ("{{ 9 ** (9 ** 9) }}", "9 ** 387420489, a number of more than 4096 bits"),
    "repetition": ("{{ 'x' * 2**34 }}", "a repetition of more than 4194304 items"),
    "set-doubling": (
        "{% set ns = namespace(x='xxxxxxxxxx') %}{% for i in range(40) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}"
        "{{ ns.x|length }}",
        "needs more memory than a chat template may use (256 MiB)",
    ),
    "filter-fold": ("{{ 'x'|center(999999999) }}", "needs more memory"),
    "format-fold": ("{{ '%0999999999d' % 1 }}", "needs more memory"),
    "parentheses": ("{{ " + "(" * 300 + "1" + ")" * 300 + " }}", "nests too deeply"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "nests too deeply"),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_template_bomb_is_refused_by_the_spec_within_seconds(name: str) -> None:
    """Jinja folds constants while it compiles; the spec check compiles and tries each inline template in a
    child capped in memory and time, so a hostile spec is refused instead of holding the DAG processor."""
    source, words = BOMBS[name]
    with pytest.raises(ValidationError, match=re.escape(words)):  # its own refusal, not the time bound's
        DataSpec(train="gs://bkt/t.jsonl", eval="gs://bkt/e.jsonl", chat_template=source)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ct.TemplateBoundError, match=re.escape(words)):
        ct.render(template(source), normalised(PROMPT_COMPLETION), add_generation_prompt=True)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: the child held it


def test_nested_loops_beyond_what_python_compiles_are_refused_in_one_line() -> None:
    loops = "".join(f"{{% for i{i} in messages %}}" for i in range(200)) + "x" + "{% endfor %}" * 200
    with pytest.raises(ValidationError, match="the chat template cannot be compiled") as info:
        DataSpec(train="gs://bkt/t.jsonl", eval="gs://bkt/e.jsonl", chat_template=loops)
    assert "Traceback" not in str(info.value) and len(str(info.value).splitlines()) < 6


def test_a_slow_template_with_little_output_is_stopped_by_the_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), add_generation_prompt=True)  # started
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 1.0)
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    started = time.monotonic()
    with pytest.raises(ct.TemplateBoundError, match="took more than 1 s to render one conversation"):
        ct.render(template(slow), normalised(PROMPT_COMPLETION), add_generation_prompt=True)
    assert time.monotonic() - started < 20.0  # the loop alone runs for hours
    # the next conversation gets a fresh child and renders as before
    assert ct.render(template(CHATML), normalised(PROMPT_COMPLETION), add_generation_prompt=True).startswith("<|im_")


@pytest.mark.parametrize(
    ("source", "raised"),
    [
        ("{{ 10.0 ** 400 }}", "OverflowError"),
        ("{{ 'x'.encode('no-such-codec') }}", "LookupError"),
        ("{{ messages[0]['content'] | int / 0 }}", "ZeroDivisionError"),
    ],
)
def test_whatever_a_template_raises_while_rendering_is_the_templates_failure(source: str, raised: str) -> None:
    """Not a crash of the step (exit 1, retried): a refusal naming the template's error."""
    with pytest.raises(ct.ChatTemplateError, match=f"the chat template failed to render \\({raised}"):
        ct.render(template(source), normalised(PROMPT_COMPLETION), add_generation_prompt=True)


@pytest.fixture
def fresh_renderer() -> Iterator[None]:
    """The next request starts a new child (each test's bounds then apply from its start)."""
    if template_sandbox._child is not None:
        template_sandbox._child.stop(kill=False)
    template_sandbox._child = None
    yield


def test_text_crosses_to_the_renderer_and_back_exactly() -> None:
    odd = "caf\u00e9 \u65e5\u672c \U0001f600 lone \ud800 nul \x00 end"
    text = ct.render(template("{{ messages[0]['content'] }}|{{ bos_token }}"), [{"role": "user", "content": odd}], True)
    assert text == odd + "|<|bos|>"


def test_the_renderer_is_given_no_environment(monkeypatch: pytest.MonkeyPatch, fresh_renderer: None) -> None:
    """A worker's credentials and settings are no business of a template's process."""
    monkeypatch.setenv("LORAFLOW_TEST_SECRET", "s3cret")
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), add_generation_prompt=True)
    child = template_sandbox._child
    assert child is not None
    assert Path(f"/proc/{child.proc.pid}/environ").read_bytes() == b""


def test_the_time_bound_counts_from_a_started_renderer(monkeypatch: pytest.MonkeyPatch, fresh_renderer: None) -> None:
    """The interpreter's start is not the template's time: the first answer may take both bounds."""
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 0.0)
    monkeypatch.setattr(template_sandbox, "START_LIMIT_S", 60.0)
    assert ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True).startswith("<|im_")
    template_sandbox._child.stop(kill=False)  # type: ignore[union-attr]
    template_sandbox._child = None
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 60.0)
    monkeypatch.setattr(template_sandbox, "START_LIMIT_S", 0.0)
    assert ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True).startswith("<|im_")


@pytest.mark.parametrize(("what", "call"), [("compile", "compile"), ("render one conversation", "render")])
def test_an_answer_past_the_bound_is_refused_naming_what_took_too_long(
    monkeypatch: pytest.MonkeyPatch, what: str, call: str
) -> None:
    """With no time left the answer is never waited for (deterministic: no clock race in the test)."""
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True)  # started
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 0.0)
    with pytest.raises(template_sandbox.SandboxError) as info:
        if call == "compile":
            template_sandbox.compile_check(CHATML + " ", ct.MAX_RENDER_CHARS)
        else:
            template_sandbox.render_many(CHATML, {}, [(normalised(PROMPT_COMPLETION), True)], ct.MAX_RENDER_CHARS)
    assert str(info.value) == (
        f"the chat template took more than 0 s to {what}; a chat template writes the turns it is given, "
        "not loops or computations of its own"
    )
    assert info.value.kind == "time"


def test_a_long_answer_crosses_the_pipe_whole() -> None:
    """Answers longer than a pipe's buffer arrive in pieces; all of them make the text."""
    long = "".join(f"{i:07d}" for i in range(400_000))  # 2.8 MB
    text = ct.render(template("{{ messages[0]['content'] }}"), [{"role": "user", "content": long}], True)
    assert text == long


def test_a_warm_renderer_answers_within_a_tight_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True)  # started
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 0.8)
    for _ in range(3):
        assert ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True).startswith("<|im_")


def test_each_conversation_of_an_exchange_gets_the_time_bound() -> None:
    assert template_sandbox.time_limit(1) == template_sandbox.TIME_LIMIT_S
    assert template_sandbox.time_limit(3) == 3 * template_sandbox.TIME_LIMIT_S
    assert template_sandbox.time_limit(0) == template_sandbox.TIME_LIMIT_S


def test_a_renderer_that_ends_is_named_and_the_next_request_gets_a_new_one(
    monkeypatch: pytest.MonkeyPatch, fresh_renderer: None
) -> None:
    """Not "took more than 5 s": the process ended (here: killed from outside, as the kernel's OOM killer would)."""
    monkeypatch.setattr(template_sandbox, "TIME_LIMIT_S", 120.0)
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True)
    child = template_sandbox._child
    assert child is not None
    threading.Timer(0.5, os.kill, (child.proc.pid, signal.SIGTERM)).start()
    with pytest.raises(ct.TemplateBoundError) as info:
        ct.render(template(slow), normalised(PROMPT_COMPLETION), True)
    assert str(info.value) == (
        "the chat template ended the process rendering it (exit -15) when asked to render one conversation; "
        "a chat template writes the turns it is given: simplify it"
    )
    assert ct.render(template(CHATML), normalised(PROMPT_COMPLETION), True).startswith("<|im_")
    assert template_sandbox._child is not child


def test_the_renderer_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """A template busy in a loop never reads the end of its pipe: the child must not outlive its parent."""
    code = (
        "import os, threading, time\n"
        "from loraflow.data import template_sandbox as ts\n"
        "ts.TIME_LIMIT_S = 600\n"
        "slow = '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}'\n"
        "threading.Thread(target=ts.render_many, args=(slow, {}, [([], False)], 100), daemon=True).start()\n"
        "while ts._child is None: time.sleep(0.01)\n"
        "print(ts._child.proc.pid, flush=True)\n"
        "time.sleep(1)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_forked_process_starts_its_own_renderer() -> None:
    """Two processes sharing one child's pipes would read each other's answers."""
    ct.render(template(CHATML), normalised(PROMPT_COMPLETION), add_generation_prompt=True)
    parents = template_sandbox._child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the forked child)
        ok = ct.render(template(CHATML), normalised(PROMPT_COMPLETION), add_generation_prompt=True).startswith("<|im_")
        os.write(write, b"1" if ok and template_sandbox._child is not parents else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert template_sandbox._child is parents and parents is not None and parents.alive()


def merging(text: str) -> list[int]:
    """A tokenizer where "ab" is one token and every other character its own."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("ab", i):
            out.append(1000)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def decode(ids: list[int]) -> str:
    return "".join("ab" if i == 1000 else chr(i) for i in ids)


def test_tokenizer_merging_across_the_prompt_and_answer_boundary_is_refused() -> None:
    """A trainer finding the answer as what follows the prompt's tokens needs prompt+answer to tokenize as both."""
    assert ct.check_round_tokens(merging, decode, [("x a", True), (" b", False)]) == 5
    with pytest.raises(ct.ChatTemplateError, match="merges the end of the prompt"):
        ct.check_round_tokens(merging, decode, [("xa", True), ("b", False)])
    with pytest.raises(ct.ChatTemplateError, match="does not give back the answer"):
        ct.check_round_tokens(merging, lambda ids: decode(ids).strip(), [("x", True), (" b", False)])


def test_every_round_of_a_conversation_is_checked_and_counted() -> None:
    """Each round pairs its own prompt and answer: the first prompt's "a" meets the first answer's space,
    not the second answer's "b"."""
    assert ct.check_round_tokens(merging, decode, [("x a", True), (" b", False), ("y", True), ("b", False)]) == 7
    with pytest.raises(ct.ChatTemplateError, match=re.escape("the prompt 'y a' with the start of the answer 'b'")):
        ct.check_round_tokens(merging, decode, [("x ", True), ("b", False), ("y a", True), ("b", False)])


def test_a_round_token_refusal_quotes_the_ends_that_meet_and_says_the_fix() -> None:
    prompt, answer = "p" * 40 + "a", "b" + "q" * 40
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.check_round_tokens(merging, decode, [(prompt, True), (answer, False)])
    assert str(info.value) == (
        f"the tokenizer merges the end of the prompt '...{'p' * 29}a' with the start of the answer 'b{'q' * 29}...' "
        "into other tokens, so training could not keep them apart as evaluation does; end the prompt (or begin the "
        "answer) with a separator such as a space or newline"
    )

    def dropping_tabs(ids: list[int]) -> str:
        return decode(ids).replace("\t", "")

    with pytest.raises(ct.ChatTemplateError) as info:
        ct.check_round_tokens(merging, dropping_tabs, [("\t" + "p" * 50, True), ("q", False)])
    assert str(info.value) == (
        f"the tokenizer does not give back the prompt '\\t{'p' * 39}...' from its tokens ('{'p' * 40}...'); the text "
        "changes on its way through training: use a tokenizer that round-trips its text (or remove the characters it drops)"
    )


def test_pieces_are_encoded_one_by_one_as_python_ints() -> None:
    """Token ids go into JSON (the eval prompts' ids): numpy's integers would not."""
    import numpy as np

    ids = ct.encode_pieces(lambda text: np.array([ord(c) for c in text], dtype=np.int64), ["ab", "", "c"])
    assert ids == [97, 98, 99] and {type(i) for i in ids} == {int}


# ---------------------------------------------------------------------------- resolving settings


def test_auto_takes_the_tokenizers_own_else_plain_text(tmp_path: Path) -> None:
    with_template = tokenizer_dir(tmp_path / "a", {"chat_template": CHATML, "bos_token": {"content": "<s>"}})
    own = ct.resolve("auto", with_template)
    assert own.source == CHATML and own.specials == {"bos_token": "<s>"} and "tokenizer_config.json" in own.origin
    bare = tokenizer_dir(tmp_path / "b", {"eos_token": "</s>"})
    plain = ct.resolve("auto", bare)
    assert plain.source == ct.PLAIN_TEMPLATE and plain.setting == "none" and "no chat template" in plain.origin
    with pytest.raises(ct.ChatTemplateError, match=r"has no chat template.*set data\.chat_template to none"):
        ct.resolve("tokenizer", bare)


def test_chat_template_jinja_file_wins_and_named_templates_are_found(tmp_path: Path) -> None:
    d = tokenizer_dir(
        tmp_path,
        {"chat_template": [{"name": "default", "template": TINY_TEMPLATE}, {"name": "tool_use", "template": CHATML}]},
        {"chat_template.jinja": ct.PLAIN_TEMPLATE, "additional_chat_templates/rag.jinja": CHATML + " "},
    )
    assert ct.resolve("tokenizer", d).source == ct.PLAIN_TEMPLATE
    assert ct.resolve("tokenizer:tool_use", d).source == CHATML
    assert ct.resolve("tokenizer:rag", d).source == CHATML + " "
    with pytest.raises(ct.ChatTemplateError, match=r"no template named 'chatml' \(it has: default, rag, tool_use\)"):
        ct.resolve("tokenizer:chatml", d)


def test_inline_and_none_settings(tmp_path: Path) -> None:
    d = tokenizer_dir(tmp_path, {"chat_template": TINY_TEMPLATE, "eos_token": "<|end|>"})
    inline = ct.resolve(CHATML, d)
    assert (inline.setting, inline.source) == ("inline", CHATML)
    assert ct.resolve("none", d).source == ct.PLAIN_TEMPLATE
    assert inline.digest != ct.resolve("auto", d).digest
    assert ct.ChatTemplate.from_record(inline.record()) == inline


OWN = "the tokenizer's own"
PLAIN = "none: plain text, the turns as written"
NO_TEMPLATE = PLAIN + " (auto: the tokenizer has no chat template)"
INLINE = "inline in the spec (data.chat_template)"
TOKENIZERS = {
    # a template file beside the config's named ones (newer checkpoints)
    "file": (
        {
            "chat_template": [{"name": "tool_use", "template": CHATML}],
            "bos_token": "<s>",
            "eos_token": {"content": "</s>"},
        },
        {"chat_template.jinja": TINY_TEMPLATE},
    ),
    "config": ({"chat_template": TINY_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}, {}),
    "bare": ({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, {}),
}


@pytest.mark.parametrize(
    ("tokenizer", "setting", "expected"),
    [
        ("file", "auto", ("auto", f"{OWN} (chat_template.jinja)", TINY_TEMPLATE)),
        ("file", "tokenizer", ("tokenizer", f"{OWN} (chat_template.jinja)", TINY_TEMPLATE)),
        (
            "file",
            "tokenizer:tool_use",
            ("tokenizer:tool_use", "the tokenizer's template 'tool_use' (tokenizer_config.json)", CHATML),
        ),
        ("file", "none", ("none", PLAIN, ct.PLAIN_TEMPLATE)),
        ("file", CHATML, ("inline", INLINE, CHATML)),
        ("config", "auto", ("auto", f"{OWN} (tokenizer_config.json)", TINY_TEMPLATE)),
        ("bare", "auto", ("none", NO_TEMPLATE, ct.PLAIN_TEMPLATE)),
        ("bare", "none", ("none", PLAIN, ct.PLAIN_TEMPLATE)),
    ],
)
def test_each_setting_resolves_to_the_template_the_report_names(
    tmp_path: Path, tokenizer: str, setting: str, expected: tuple[str, str, str]
) -> None:
    """The recorded setting and origin say which template rendered a run; every setting is given the
    tokenizer's special tokens."""
    d = tokenizer_dir(tmp_path, *TOKENIZERS[tokenizer])
    resolved = ct.resolve(setting, d)
    assert resolved == ct.ChatTemplate(*expected, {"bos_token": "<s>", "eos_token": "</s>"})
    assert ct.own_template_digest(d) == ct.resolve("auto", d).digest


def test_only_the_special_tokens_the_tokenizer_has_are_given(tmp_path: Path) -> None:
    config = {
        "bos_token": "",
        "eos_token": {"content": "</s>", "special": True},
        "pad_token": {"content": ""},
        "unk_token": 0,
        "sep_token": "<sep>",  # not one a chat template is given
    }
    assert ct.resolve("none", tokenizer_dir(tmp_path, config)).specials == {"eos_token": "</s>"}


def test_tokenizer_without_its_own_template_names_the_ones_it_has(tmp_path: Path) -> None:
    named = tokenizer_dir(
        tmp_path / "named",
        {"chat_template": [{"name": "tool_use", "template": CHATML}]},
        {"additional_chat_templates/rag.jinja": CHATML},
    )
    bare = tokenizer_dir(tmp_path / "bare", {})
    fix = "set data.chat_template to none (plain text) or give the template inline"
    for d, has in ((named, " (it has named ones: rag, tool_use; use tokenizer:NAME)"), (bare, "")):
        with pytest.raises(ct.ChatTemplateError) as info:
            ct.resolve("tokenizer", d)
        assert str(info.value) == f"chat_template: tokenizer, but the tokenizer in {d} has no chat template{has}; {fix}"
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.resolve("tokenizer:rag", bare)
    assert str(info.value) == (
        f"chat_template tokenizer:rag: the tokenizer in {bare} has no template named 'rag' (it has: none); "
        "name one of those, or use tokenizer, none or an inline template"
    )


def test_named_templates_that_are_not_a_name_and_a_template_are_skipped(tmp_path: Path) -> None:
    entries = ["tool_use", {"name": "rag"}, {"template": CHATML}, {"name": 7, "template": CHATML}]
    d = tokenizer_dir(tmp_path, {"chat_template": [*entries, {"name": "ok", "template": CHATML}]})
    with pytest.raises(ct.ChatTemplateError, match=re.escape("no template named 'rag' (it has: ok)")):
        ct.resolve("tokenizer:rag", d)


def test_a_tokenizer_without_tokenizer_config_json_is_read_from_its_template_file(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert ct.resolve("auto", tmp_path) == ct.ChatTemplate("auto", f"{OWN} (chat_template.jinja)", CHATML, {})


def test_a_tokenizer_config_that_is_not_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.resolve("none", tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'tokenizer_config.json'} is not JSON (Expecting property name")
    assert message.endswith("); fix the tokenizer files")
    assert ct.own_template_digest(tmp_path) is None


@pytest.mark.parametrize("config", [["chat_template", CHATML], CHATML, None])
def test_a_tokenizer_config_that_is_not_an_object_is_refused(tmp_path: Path, config: object) -> None:
    """Not taken for a tokenizer without a template: auto would train on plain text without its EOS token."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for setting in ("auto", "none"):
        with pytest.raises(ct.ChatTemplateError) as info:
            ct.resolve(setting, tmp_path)
        assert str(info.value) == f"{tmp_path / 'tokenizer_config.json'} is not a JSON object; fix the tokenizer files"


@contextlib.contextmanager
def ascii_locale() -> Iterator[None]:
    """A worker started with LC_ALL=C (a bare container): Python's default text encoding is then ASCII."""
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)


def test_tokenizer_files_and_the_record_are_utf8_whatever_the_locale(tmp_path: Path) -> None:
    def say(words: str) -> str:
        return CHATML.replace("You are helpful.", words)

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    config = {"chat_template": [{"name": "fr", "template": say("Réponds en français.")}], "eos_token": "▁</s>"}
    (tok / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (tok / "chat_template.jinja").write_text(say("Antworte höflich."), encoding="utf-8")
    (tok / "additional_chat_templates").mkdir()
    (tok / "additional_chat_templates" / "ja.jinja").write_text(say("日本語で答えて"), encoding="utf-8")
    with ascii_locale():
        assert ct.resolve("tokenizer:fr", tok).source == say("Réponds en français.")
        assert ct.resolve("tokenizer:ja", tok).source == say("日本語で答えて")
        own = ct.resolve("tokenizer", tok)
        assert (own.source, own.specials) == (say("Antworte höflich."), {"eos_token": "▁</s>"})
        ct.write_record(own, tmp_path)
        assert ct.read_record(tmp_path) == own


def test_the_digest_covers_the_special_tokens() -> None:
    """Equal digests must mean equal text: a template given another BOS or EOS renders other text."""
    base = template(CHATML).digest
    assert ct.ChatTemplate("inline", "test", CHATML, SPECIALS | {"bos_token": "<s>"}).digest != base
    assert ct.ChatTemplate("inline", "test", CHATML, SPECIALS | {"eos_token": "</s>"}).digest != base
    assert ct.ChatTemplate("inline", "other words", CHATML, SPECIALS).digest == base


def test_a_record_with_tampered_special_tokens_is_refused(tmp_path: Path) -> None:
    record = template(CHATML).record()
    record["specials"] = {**record["specials"], "eos_token": "<|other|>"}
    (tmp_path / ct.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(ct.ChatTemplateError, match="sha256 does not match"):
        ct.read_record(tmp_path)


def test_a_tampered_record_is_refused(tmp_path: Path) -> None:
    record = template(CHATML).record() | {"source": CHATML + "x"}
    (tmp_path / ct.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(ct.ChatTemplateError, match="sha256 does not match"):
        ct.read_record(tmp_path)


def test_the_record_is_written_for_people_and_read_back_whole(tmp_path: Path) -> None:
    t = ct.ChatTemplate(
        "tokenizer", f"{OWN} (chat_template.jinja)", CHATML.replace("You are helpful.", "Sei höflich."), SPECIALS
    )
    path = ct.write_record(t, tmp_path)
    assert path == tmp_path / "chat_template.json"
    text = path.read_text(encoding="utf-8")
    assert text.startswith('{\n  "setting": "tokenizer",\n') and text.endswith("}\n") and "Sei höflich." in text
    assert ct.read_record(tmp_path) == t
    assert t.summary() == {"setting": "tokenizer", "origin": f"{OWN} (chat_template.jinja)", "sha256": t.digest}
    assert ct.read_record(tmp_path / "elsewhere") is None


def test_a_record_that_is_not_one_is_refused_naming_its_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / ct.RECORD_FILE
    path.write_text(json.dumps({"setting": "inline", "origin": "test"}))
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.read_record(tmp_path)
    assert str(info.value) == f"{path} is not a chat template record ('source'); re-run validate_data to write it"
    path.write_text("{")
    with pytest.raises(ct.ChatTemplateError) as info:
        ct.read_record(tmp_path)
    assert str(info.value).startswith(f"{path} is not JSON (Expecting property name")
    assert str(info.value).endswith("); re-run validate_data to write it")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("chatml", "is not a setting; use auto"),
        ("{% for m in messages %}", "not valid Jinja"),
        ("tokenizer:", "needs the name"),
        ("", "must be one of"),
    ],
)
def test_the_spec_refuses_bad_settings(value: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DataSpec(train="gs://bkt/t.jsonl", eval="gs://bkt/e.jsonl", chat_template=value)


def test_a_setting_that_is_none_of_them_is_quoted_up_to_80_characters() -> None:
    fix = f"is not a setting; use {ct.SETTINGS_HELP}"
    for setting, shown in (("x" * 80, "x" * 80), ("y" + "x" * 80, "y" + "x" * 79 + "... (81 characters)")):
        with pytest.raises(ValueError) as info:
            ct.check_setting(setting)
        assert str(info.value) == f"chat_template {shown!r} {fix}"


def test_a_named_setting_without_its_name_says_what_to_write() -> None:
    with pytest.raises(ValueError) as info:
        ct.check_setting("tokenizer:  ")
    assert str(info.value) == "chat_template tokenizer:NAME needs the name of one of the tokenizer's templates"


def test_the_spec_default_is_auto() -> None:
    assert DataSpec(train="gs://bkt/t.jsonl", eval="gs://bkt/e.jsonl").chat_template == "auto"


# ---------------------------------------------------------------------------- validate_data


@pytest.fixture
def run_validate(tmp_path: Path, tokenizer_dir: Path, make_ctx: Callable) -> Callable:
    def run(train: list[dict], eval_: list[dict], **config: object) -> tuple[object, object]:
        inputs: dict[str, Path] = {"tokenizer": tokenizer_dir}
        for split, rows in (("train", train), ("eval", eval_)):
            d = tmp_path / "in" / split
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            inputs[split] = d
        ctx = make_ctx("validate_data", inputs, {"expectations": {"row_count": {"min": 1}}, **config})
        try:
            return validate_data.run(ctx), ctx
        except DataValidationError as exc:
            return exc, ctx

    return run


def _rows(n: int, prefix: str) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "prompt": f"{prefix} question {i} of {n}", "completion": f"answer {i}"} for i in range(n)
    ]


def test_validate_data_hands_the_resolved_template_on(run_validate: Callable, tokenizer_dir: Path) -> None:
    summary, ctx = run_validate(_rows(20, "t"), _rows(5, "e"), chat_template=CHATML)
    assert isinstance(summary, dict), summary
    recorded = ct.read_record(ctx.out)
    assert recorded is not None and recorded.source == CHATML and recorded.setting == "inline"
    assert summary["chat_template"] == recorded.summary()
    report = json.loads((ctx.out / "data_report.json").read_text())
    assert report["chat_template"]["sha256"] == recorded.digest


def test_validate_data_names_the_rows_a_template_refuses(run_validate: Callable) -> None:
    picky = "{% if 'bad' in messages[0]['content'] %}{{ raise_exception('bad prompt') }}{% endif %}" + CHATML
    train = _rows(20, "t")
    train[3]["prompt"] = "a bad one"
    result, ctx = run_validate(train, _rows(5, "e"), chat_template=picky)
    assert isinstance(result, DataValidationError)
    assert "cannot render 1 row(s)" in str(result) and "train line 4" in str(result) and "bad prompt" in str(result)
    assert not (ctx.out / ct.RECORD_FILE).exists() and not (ctx.out / "train.jsonl").exists()


def test_validate_data_stops_at_the_first_row_a_template_breaks_a_bound_on(run_validate: Callable) -> None:
    """A template that passed the spec's check but runs away on a row refuses the data there, naming the template
    and the row (the step does not crash and get retried, nor spend the time bound on every other row)."""
    bomb = "{% if 'bomb' in messages[0]['content'] %}{{ 9 ** (9 ** 9) }}{% endif %}" + CHATML
    train = _rows(20, "t")
    train[3]["prompt"] = "a bomb"
    result, ctx = run_validate(train, _rows(5, "e"), chat_template=bomb)
    assert isinstance(result, DataValidationError)
    assert "data.chat_template (inline in the spec" in str(result) and "train line 4" in str(result)
    assert "a number of more than 4096 bits" in str(result)
    assert not (ctx.out / ct.RECORD_FILE).exists() and not (ctx.out / "train.jsonl").exists()


def test_validate_data_refuses_a_named_template_the_tokenizer_lacks(run_validate: Callable) -> None:
    result, _ = run_validate(_rows(20, "t"), _rows(5, "e"), chat_template="tokenizer:tool_use")
    assert isinstance(result, DataValidationError)
    assert "no template named 'tool_use'" in str(result)


# ---------------------------------------------------------------------------------- the report


def _run_data(**digests: str) -> dict:
    """The report's data with each stage's recorded template (stage -> digest)."""
    keys = {"validate_data": "data_report", "lora_sft": "training_summary"}
    keys |= {"evaluate_base": "base_metrics", "evaluate_tuned": "tuned_metrics"}
    return {
        keys[stage]: {"chat_template": {"setting": "auto", "origin": "the tokenizer's own", "sha256": digest * 64}}
        for stage, digest in digests.items()
    }


def test_the_report_shows_which_template_each_stage_rendered_with() -> None:
    from loraflow.reporting import report

    page = report.render(_run_data(validate_data="a", lora_sft="a", evaluate_base="a", evaluate_tuned="a"))
    assert 'id="templates"' in page and "All 4 stage(s) rendered prompts with the same chat template" in page
    assert "rendered the tuned model&#x27;s eval prompts" in page and "aaaaaaaaaaaa" in page
    assert "MISMATCH" not in page


def test_the_report_flags_a_template_mismatch_in_the_verdict() -> None:
    from loraflow.reporting import report

    data = _run_data(validate_data="a", lora_sft="a", evaluate_base="a", evaluate_tuned="b")
    assert report.template_mismatch(data) is not None
    page = report.render(data)
    verdict = page[page.index('id="verdict"') : page.index('id="metrics"')]
    assert "CHAT TEMPLATE MISMATCH" in verdict and "evaluate_tuned bbbbbbbbbbbb" in verdict
    assert report.template_mismatch(_run_data(lora_sft="a")) is None
