"""The one prompt renderer: how a conversation becomes text, for training, evaluation and the report.

Every path that turns chat ``messages`` into model text calls this module, so training and
evaluation cannot drift apart (a model trained on one rendering and scored on another loses
points silently):

* validate_data resolves the spec's ``data.chat_template`` against the tokenizer, renders every
  row (token lengths; a row the template refuses is named) and writes the resolved template into
  its output as ``chat_template.json`` (:data:`RECORD_FILE`) beside train.jsonl and eval.jsonl;
* lora_sft reads that record and cuts each training conversation into prompt and answer pieces
  (:func:`pieces`); MaxText tokenizes the pieces as given and trains on the answer pieces only;
* evaluate (vLLM) and lora_sft's QLoRA answers read the same record and render each eval prompt
  with :func:`prompt_pieces`: the same pieces, the same token ids;
* the evaluation and the adapter record which template rendered them (:meth:`ChatTemplate.record`),
  and the report sets them side by side.

Settings (``data.chat_template``):

``auto`` (default)
    the tokenizer's own template when it has one, otherwise ``none``;
``tokenizer``
    the tokenizer's own (default) template; an error when it has none;
``tokenizer:NAME``
    one of the tokenizer's named templates (``tokenizer_config.json`` holding a list of
    ``{"name", "template"}``, or ``additional_chat_templates/NAME.jinja``);
``none``
    plain text: the BOS token (when the tokenizer has one), then every turn's content exactly as
    written, no separators, and the EOS token after each answer (:data:`PLAIN_TEMPLATE`); for
    prompt/completion data of a base model whose prompts carry their own separators;
an inline Jinja template
    any text holding ``{{`` or ``{%``: an HF-style chat template (``messages``,
    ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``{% generation %}``).

A template is compiled and run sandboxed (jinja2's ImmutableSandboxedEnvironment, as Hugging Face
runs them) in a child process capped in memory and time (loraflow/data/template_sandbox.py): a
hostile spec or tokenizer cannot reach Python objects, change state, or hold the process that asked
(the DAG processor, a step) through it.

Library code: the standard library here, jinja2 in the child; the tokenizer's files are read by
:func:`resolve`, nothing else touches the world.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

from loraflow.data import template_sandbox
from loraflow.errors import LoraflowError

RECORD_FILE = "chat_template.json"
AUTO, TOKENIZER, NONE = "auto", "tokenizer", "none"
NAMED_PREFIX = "tokenizer:"
# One conversation's rendering may take at most this much text (its time: template_sandbox.TIME_LIMIT_S).
MAX_RENDER_CHARS = 4 * 2**20
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# ``none``: the turns as written, the BOS first, the EOS closing each answer (the tokenizer's own).
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}"
)
# What MaxText is given: each piece loraflow rendered, written as it is (see loraflow.trainer.data).
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SETTINGS_HELP = (
    "auto (the tokenizer's own, else none), tokenizer, tokenizer:NAME (a named template of the tokenizer), "
    "none (plain text) or an inline Jinja chat template (holding {{ or {%)"
)


class ChatTemplateError(LoraflowError):
    """A chat template setting, template or rendering that cannot be used; the message says the fix."""


class TemplateBoundError(ChatTemplateError):
    """A template that broke a bound (time, memory, size, nesting): it fails whatever rows it is given."""


def _refuse(exc: template_sandbox.SandboxError) -> NoReturn:
    raise (TemplateBoundError if exc.kind in template_sandbox.BOUNDS else ChatTemplateError)(str(exc)) from None


# ------------------------------------------------------------------------------------ settings


def is_inline(setting: str) -> bool:
    return "{{" in setting or "{%" in setting


def check_setting(setting: str) -> str:
    """``setting`` if it is one loraflow understands (an inline template must compile); else a ValueError."""
    if not isinstance(setting, str) or not setting.strip():
        raise ValueError(f"chat_template must be one of: {SETTINGS_HELP}")
    if setting in (AUTO, TOKENIZER, NONE):
        return setting
    if setting.startswith(NAMED_PREFIX):
        if not setting[len(NAMED_PREFIX) :].strip():
            raise ValueError("chat_template tokenizer:NAME needs the name of one of the tokenizer's templates")
        return setting
    if not is_inline(setting):
        shown = setting if len(setting) <= 80 else setting[:80] + f"... ({len(setting)} characters)"
        raise ValueError(f"chat_template {shown!r} is not a setting; use {SETTINGS_HELP}")
    try:
        _compile(setting)
        _probe(setting)
    except ChatTemplateError as exc:
        raise ValueError(str(exc)) from None
    return setting


# A conversation every chat template must be able to render (an inline one is tried on it when the spec is read).
_PROBE = ({"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello"})


@lru_cache(maxsize=32)
def _probe(source: str) -> None:
    """Refuse a template that breaks a bound (time, memory, size, depth) on :data:`_PROBE`; one that refuses
    the conversation itself (``raise_exception``, a missing system turn ...) is judged on the data instead."""
    try:
        template_sandbox.render_many(source, {}, [(_PROBE, False)], MAX_RENDER_CHARS)
    except template_sandbox.SandboxError as exc:
        if exc.kind in template_sandbox.BOUNDS:
            _refuse(exc)


# ------------------------------------------------------------------------------------ the template


@dataclass(frozen=True)
class ChatTemplate:
    """A resolved template: its Jinja text, where it came from and the special tokens it is given."""

    setting: str  # as the spec says it ("auto", "tokenizer", "tokenizer:NAME", "none", "inline")
    origin: str  # in words: which template this is ("the tokenizer's own (tokenizer_config.json)", ...)
    source: str  # the Jinja text
    specials: Mapping[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... (present ones only)

    @property
    def digest(self) -> str:
        """sha256 of the template and its special tokens: equal digests render equal text."""
        payload = json.dumps({"source": self.source, "specials": dict(sorted(self.specials.items()))})
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def record(self) -> dict[str, Any]:
        """What an artifact stores (and :meth:`from_record` reads back)."""
        return {
            "setting": self.setting,
            "origin": self.origin,
            "sha256": self.digest,
            "source": self.source,
            "specials": dict(self.specials),
        }

    def summary(self) -> dict[str, str]:
        """What a manifest summary or report shows: setting, origin and digest (no template text)."""
        return {"setting": self.setting, "origin": self.origin, "sha256": self.digest}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str = RECORD_FILE) -> ChatTemplate:
        try:
            template = cls(
                str(record["setting"]),
                str(record["origin"]),
                str(record["source"]),
                {str(k): str(v) for k, v in dict(record.get("specials") or {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ChatTemplateError(
                f"{where} is not a chat template record ({exc}); re-run validate_data to write it"
            ) from None
        if record.get("sha256") not in (None, template.digest):
            raise ChatTemplateError(f"{where}: its sha256 does not match its template; re-run validate_data")
        _compile(template.source)
        return template


def read_record(directory: Path) -> ChatTemplate | None:
    """The record validate_data wrote into ``directory`` (its output); None when there is none."""
    path = Path(directory) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        return ChatTemplate.from_record(json.loads(path.read_text(encoding="utf-8")), str(path))
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{path} is not JSON ({exc}); re-run validate_data to write it") from None


def write_record(template: ChatTemplate, directory: Path) -> Path:
    path = Path(directory) / RECORD_FILE
    path.write_text(json.dumps(template.record(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------- resolving


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tokenizer_files(tokenizer_dir: Path) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """tokenizer_config.json and the tokenizer's templates: name -> (where, source); the default is "default"."""
    tokenizer_dir = Path(tokenizer_dir)
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{cfg_path} is not JSON ({exc}); fix the tokenizer files") from None
    if not isinstance(cfg, dict):  # not "no template": auto would then drop the template and the EOS token
        raise ChatTemplateError(f"{cfg_path} is not a JSON object; fix the tokenizer files")
    templates: dict[str, tuple[str, str]] = {}
    found = cfg.get("chat_template")
    if isinstance(found, str) and found:
        templates["default"] = ("tokenizer_config.json", found)
    elif isinstance(found, list):
        for entry in found:
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                templates[entry["name"]] = ("tokenizer_config.json", entry["template"])
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():  # newer checkpoints keep the default template in its own file; it wins
        templates["default"] = ("chat_template.jinja", jinja.read_text(encoding="utf-8"))
    extra = tokenizer_dir / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates.setdefault(
                path.stem, (f"additional_chat_templates/{path.name}", path.read_text(encoding="utf-8"))
            )
    return cfg, templates


def specials_of(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens a template is given (those the tokenizer has)."""
    out = {}
    for key in SPECIAL_TOKENS:
        text = _token_text(tokenizer_config.get(key))
        if text is not None:
            out[key] = text
    return out


def resolve(setting: str, tokenizer_dir: Path) -> ChatTemplate:
    """The template ``setting`` names, for the tokenizer in ``tokenizer_dir`` (see the module docstring)."""
    check_setting(setting)
    cfg, templates = _tokenizer_files(tokenizer_dir)
    specials = specials_of(cfg)
    if setting == NONE or (setting == AUTO and "default" not in templates):
        why = "" if setting == NONE else " (auto: the tokenizer has no chat template)"
        return ChatTemplate(NONE, f"none: plain text, the turns as written{why}", PLAIN_TEMPLATE, specials)
    if setting in (AUTO, TOKENIZER):
        if "default" not in templates:
            others = f" (it has named ones: {', '.join(sorted(templates))}; use tokenizer:NAME)" if templates else ""
            raise ChatTemplateError(
                f"chat_template: tokenizer, but the tokenizer in {tokenizer_dir} has no chat template{others}; "
                "set data.chat_template to none (plain text) or give the template inline"
            )
        where, source = templates["default"]
        _compile(source)
        return ChatTemplate(setting, f"the tokenizer's own ({where})", source, specials)
    if setting.startswith(NAMED_PREFIX):
        name = setting[len(NAMED_PREFIX) :].strip()
        if name not in templates:
            have = ", ".join(sorted(templates)) or "none"
            raise ChatTemplateError(
                f"chat_template {setting}: the tokenizer in {tokenizer_dir} has no template named {name!r} "
                f"(it has: {have}); name one of those, or use tokenizer, none or an inline template"
            )
        where, source = templates[name]
        _compile(source)
        return ChatTemplate(setting, f"the tokenizer's template {name!r} ({where})", source, specials)
    return ChatTemplate("inline", "inline in the spec (data.chat_template)", setting, specials)


def own_template_digest(tokenizer_dir: Path) -> str | None:
    """The digest ``auto`` would resolve to for this tokenizer (None when its files cannot say)."""
    try:
        return resolve(AUTO, tokenizer_dir).digest
    except ChatTemplateError:
        return None


# ----------------------------------------------------------------------------------- rendering


@lru_cache(maxsize=32)
def _compile(source: str) -> None:
    """Nothing when ``source`` compiles as a chat template (in the bounded child: template_sandbox)."""
    try:
        template_sandbox.compile_check(source, MAX_RENDER_CHARS)
    except template_sandbox.SandboxError as exc:
        _refuse(exc)


def _turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    return [
        {"role": str(m["role"]), "content": "" if m.get("content") is None else str(m["content"])} for m in messages
    ]


def render(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
    """The text of ``messages`` under ``template``, rendered sandboxed in a child process bounded in time and
    memory (loraflow/data/template_sandbox.py); ChatTemplateError names what failed."""
    return render_many(template, [(messages, add_generation_prompt)])[0]


def render_many(template: ChatTemplate, conversations: Sequence[tuple[Sequence[Mapping[str, Any]], bool]]) -> list[str]:
    """:func:`render` of each (messages, add_generation_prompt), in one exchange with the sandbox."""
    try:
        return template_sandbox.render_many(
            template.source, template.specials, [(_turns(m), prompt) for m, prompt in conversations], MAX_RENDER_CHARS
        )
    except template_sandbox.SandboxError as exc:
        _refuse(exc)


Piece = tuple[str, bool]  # (text, is_prompt): the prompt side is never trained on


def pieces(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> list[Piece]:
    """A training conversation as alternating prompt and answer pieces whose concatenation is its text.

    Each answer piece is the text the template writes for an assistant turn after that turn's
    generation prompt, through to where the next turn's prompt begins: exactly what the model must
    produce when evaluation renders the turns before it with ``add_generation_prompt``. Turns after
    the last answer are dropped (nothing to learn from them).

    Errors (each names the fix): no assistant turn; a template whose generation prompt is not how
    it begins the assistant's turn; one that renders earlier turns differently once later turns
    follow (the prompt evaluation sees would then not be the one training saw); one with no
    generation prompt whose answer piece starts with text other than the answer (a turn header
    the model would have to write itself).
    """
    out: list[Piece] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, full, bare = render_many(
            template, [(messages[:i], True), (messages[: i + 1], False), (messages[:i], False)]
        )
        if not prompt.startswith(done):
            raise ChatTemplateError(
                f"the chat template renders the turns before turn {i} differently once turn {i} follows "
                f"(before: {_tail(done)!r}; after: {_tail(prompt[: len(done)])!r}); training and evaluation "
                "would see different prompts: keep one answer per row or use a template that keeps history as written"
            )
        if not full.startswith(prompt):
            raise ChatTemplateError(
                f"the chat template's generation prompt {_tail(prompt[len(done) :])!r} is not how it begins the "
                f"assistant's turn {i} ({_head(full[len(done) :])!r}); evaluation would prompt the model differently "
                "from training: fix the template's add_generation_prompt branch"
            )
        answer = full[len(prompt) :]
        if prompt == bare:
            _check_no_header(answer, message, i)
        out += [(prompt[len(done) :], True), (answer, False)]
        done = full
    if not out:
        raise ChatTemplateError("the conversation has no assistant turn: nothing to train on; add the answer")
    return out


def _check_no_header(answer: str, message: Mapping[str, Any], i: int) -> None:
    """A template whose generation prompt is empty must not put a turn header before the answer."""
    content = "" if message.get("content") is None else str(message["content"]).strip()
    at = answer.find(content)  # 0 for an empty answer: nothing before it
    if at > 0 and answer[:at].strip():
        raise ChatTemplateError(
            f"the chat template writes {answer[:at]!r} before the assistant's answer in turn {i} but not as its "
            "generation prompt (add_generation_prompt adds nothing): at evaluation the model would have to write "
            "its own turn header; give a template whose add_generation_prompt branch writes it"
        )


def prompt_pieces(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """An eval prompt (turns ending with a user turn) as the pieces training cut its prefix into.

    The earlier turns split where :func:`pieces` splits them, and the last piece runs to the end of
    the generation prompt, so the prompt's token ids (each piece tokenized alone, as training
    tokenizes them) are those the trained model saw before its answer.
    """
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    out = [text for text, _ in pieces(template, messages[: last + 1])] if last >= 0 else []  # each turn rendered once
    done = "".join(out)
    prompt = render(template, messages, add_generation_prompt=True)
    if not prompt.startswith(done):
        raise ChatTemplateError(
            "the chat template renders the earlier turns of this prompt differently once the last turn follows; "
            "training and evaluation would see different prompts: use a template that keeps history as written"
        )
    return [*out, prompt[len(done) :]]


def render_prompt(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> str:
    """An eval prompt's text: the turns and the generation prompt."""
    return "".join(prompt_pieces(template, messages))


def check_round_tokens(
    encode: Callable[[str], Sequence[int]], decode: Callable[[list[int]], str], parts: Sequence[Piece]
) -> int:
    """The token count of a training conversation's pieces; an error when a round would not split where
    loraflow cut it.

    A trainer that finds the answer of a round (prompt piece + answer piece) as what follows the
    longest common token prefix of the round and the prompt alone, and turns tokens back into text
    between steps, gets loraflow's pieces only when the round tokenizes as its two pieces do and
    each piece's tokens decode to the piece. Otherwise the prompt the model trains on differs from
    the one evaluation sends it.
    """
    total = 0
    for k in range(0, len(parts) - 1, 2):
        prompt, answer = parts[k][0], parts[k + 1][0]
        ids_prompt, ids_answer = list(encode(prompt)), list(encode(answer))
        if list(encode(prompt + answer)) != ids_prompt + ids_answer:
            raise ChatTemplateError(
                f"the tokenizer merges the end of the prompt {_tail(prompt, 30)!r} with the start of the answer "
                f"{_head(answer, 30)!r} into other tokens, so training could not keep them apart as evaluation "
                "does; end the prompt (or begin the answer) with a separator such as a space or newline"
            )
        for what, text, ids in (("prompt", prompt, ids_prompt), ("answer", answer, ids_answer)):
            if decode(ids) != text:
                raise ChatTemplateError(
                    f"the tokenizer does not give back the {what} {_head(text, 40)!r} from its tokens "
                    f"({_head(decode(ids), 40)!r}); the text changes on its way through training: "
                    "use a tokenizer that round-trips its text (or remove the characters it drops)"
                )
        total += len(ids_prompt) + len(ids_answer)
    return total


def encode_pieces(encode: Callable[[str], Sequence[int]], texts: Sequence[str]) -> list[int]:
    """Token ids of pieces, each encoded alone (no special tokens: the template writes them)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(int(t) for t in encode(text))
    return ids


def _tail(text: str, n: int = 60) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _head(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."
