"""Conversations through a tokenizer directory's own chat template (Llama 3, Mistral: tokenizers
without ChatML's special tokens), with an assistant-only loss mask.

The template (tokenizer_config.json's "chat_template", or chat_template.jinja beside it) is
rendered with jinja2 as transformers renders it (a sandbox, trim_blocks and lstrip_blocks, the
loop-controls extension, `raise_exception`, `strftime_now`, bos_token / eos_token, tools and
documents none, `{% generation %}` blocks rendered as they are). `strftime_now` gives the date the
tokenizer was loaded, so a record renders the same every time within a run (Llama 3.2's template
writes today's date into every system header). Nothing is downloaded; transformers is not needed.

Where each assistant turn is: the template is rendered for the conversation up to the turn with
the generation prompt (`prompt`), and up to and including the turn (`upto`); the turn is the text
`upto` adds to `prompt`: the reply and whatever the template closes it with (Llama 3's
<|eot_id|>, Mistral's </s>), which is what a model must learn to generate. That needs a template
whose renderings of a conversation's beginnings are beginnings of its rendering; where they are
not (a template that moves the system message to the last user turn, or writes the last assistant
turn differently), the record is refused with that reason, never trained with a guessed mask.

The whole rendering is tokenized once, its special tokens parsed; a token is a target when it
starts inside an assistant turn. A message whose text holds one of the tokenizer's special tokens
is refused (it would be parsed as that token, e.g. end its turn early), as is a tokenization that
merges a turn's first or last character with the template's text around it.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_chunkflow.data.chat import BadRecord, counted_sequence, normalize_messages
from megatron_chunkflow.data.sequence import TokenSequence


def read_chat_template(directory: Path) -> str | None:
    """The directory's chat template: chat_template.jinja (transformers >= 4.43 saves it there),
    else tokenizer_config.json's "chat_template" (a string, or named templates: "default");
    None when it has none. ValueError naming the file when it cannot be read."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = _json_object(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory / 'tokenizer_config.json'}: chat_template is "
                         f"{type(template).__name__}, not a Jinja template string")
    return template


def _json_object(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from None
    return config if isinstance(config, dict) else {}


def special_token_text(directory: Path, key: str) -> str | None:
    """The bos_token / eos_token as text (a string or {"content": ...}): tokenizer_config.json's,
    else special_tokens_map.json's; None when neither names it."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        value = _json_object(directory / name).get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            return value
    return None


def _generation_blocks():
    """{% generation %}...{% endgeneration %} (transformers' marks for its assistant mask): their
    body is rendered as it is; the mask here comes from the prefix renders."""
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            from jinja2 import nodes

            return nodes.Scope(body, lineno=lineno)

    return GenerationBlocks


class TemplateChat:
    """A tokenizer directory's chat template as the data layer's `encode_chat`: a record's
    messages to its one sequence."""

    def __init__(self, template: str, hf_tokenizer, specials: list[str], bos: str | None,
                 eos: str | None, where: str):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise BadRecord(f"the chat template refused this conversation: {message}")

        from datetime import datetime

        loaded = datetime.now()  # one date per run: every rendering of a record is the same

        def strftime_now(fmt):
            return loaded.strftime(fmt)

        def tojson(x, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
            return json.dumps(x, indent=indent, separators=separators, sort_keys=sort_keys,
                              ensure_ascii=ensure_ascii)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _generation_blocks()])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as e:
            raise ValueError(f"{where}: the chat template is not valid Jinja: {e}") from None
        self._hf, self._specials = hf_tokenizer, sorted(set(specials), key=len, reverse=True)
        # what transformers passes besides the messages (tools and documents: none)
        self._names = {"bos_token": bos or "", "eos_token": eos or "", "tools": None,
                       "documents": None}

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=
                                         add_generation_prompt, **self._names)
        except BadRecord:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise BadRecord(f"the chat template failed on this conversation: "
                            f"{type(e).__name__}: {e}") from None

    def __call__(self, messages) -> list[TokenSequence]:
        return [self.encode(messages)]

    def encode(self, messages) -> TokenSequence:
        """Tokens and target-aligned loss mask of one conversation (BadRecord: why not)."""
        turns = [{"role": r, "content": c} for r, c in normalize_messages(messages)]
        for i, turn in enumerate(turns):
            token = next((s for s in self._specials if s in turn["content"]), None)
            if token is not None:
                raise BadRecord(f"message {i} ({turn['role']}) holds the text of the special "
                                f"token {token!r}, which this tokenizer's chat template would "
                                "parse as that token")
        text = self.render(turns, add_generation_prompt=False)
        spans = []
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            prompt = self.render(turns[:i], add_generation_prompt=True)
            upto = self.render(turns[:i + 1], add_generation_prompt=False)
            if not (upto.startswith(prompt) and text.startswith(upto)):
                raise BadRecord(f"the chat template renders the conversation up to message {i} "
                                "otherwise than as the beginning of the whole conversation, so "
                                "the assistant turn cannot be located (e.g. a system message "
                                "moved to the last user turn)")
            spans.append((len(prompt), len(upto)))
        enc = self._hf.encode(text, add_special_tokens=False)
        counts = []
        for start, end in enc.offsets:
            span = next(((a, b) for a, b in spans if start < b and max(end, start + 1) > a), None)
            if span is not None and not (span[0] <= start and end <= span[1]):
                raise BadRecord(f"a token spans characters {start}-{end} of the rendered "
                                f"conversation, across the edge of the assistant turn at "
                                f"{span[0]}-{span[1]}: the loss mask cannot follow it")
            counts.append(span is not None)
        return counted_sequence(list(enc.ids), counts)
