"""ChatML encoding as Qwen2.5's chat template renders it, with an assistant-only loss mask.

Each message becomes `<|im_start|>{role}\\n{content}<|im_end|>\\n`; when the first message is not a
system message, the tokenizer's default system message (Qwen2.5's; none for a directory whose own
template has none, e.g. Qwen3's) is put first. The targets that count are the
tokens of each assistant message's content and its closing <|im_end|>; the header
"<|im_start|>assistant\\n" and the "\\n" after <|im_end|> do not count. Tokens are built piece by
piece, so the mask is exact. Special tokens split the text before BPE, so the only boundary that
can differ from tokenizing the whole rendered string is header/content; `_header_and_content`
checks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_chunkflow.data.sequence import TokenSequence

if TYPE_CHECKING:  # annotations only: data/tokenizer.py imports this module's helpers
    from megatron_chunkflow.data.tokenizer import Tokenizer

QWEN25_SYSTEM_MESSAGE = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
DEFAULT_SYSTEM_MESSAGE = QWEN25_SYSTEM_MESSAGE
ROLES = ("system", "user", "assistant")
# ShareGPT's "from" values; the ChatML names are accepted there too.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant"}


class BadRecord(ValueError):
    """A record that cannot become a training sample; the message is a short reason."""


def normalize_messages(messages, require_assistant: bool = True) -> list[tuple[str, str]]:
    """(role, content) pairs from dicts with `role`/`content` or ShareGPT's `from`/`value`.
    Raises BadRecord for an empty list, an unknown role, a non-string content, or (when
    `require_assistant`) no assistant message. Megatron-LM's SFT dataset trains on such a record
    too (its only target is the EOD), so its reader passes False to read the same records."""
    if not isinstance(messages, (list, tuple)):
        raise BadRecord(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise BadRecord("empty conversation")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} is a {type(m).__name__}, not an object")
        if "role" in m:
            role, content = m["role"], m.get("content")
            if role not in ROLES:
                raise BadRecord(f"message {i} has unknown role {role!r} (expected one of "
                                f"{', '.join(ROLES)})")
        elif "from" in m:
            role, content = SHAREGPT_ROLES.get(m["from"]), m.get("value")
            if role is None:
                raise BadRecord(f"message {i} has unknown ShareGPT role {m['from']!r} "
                                "(expected human, gpt or system)")
        else:
            raise BadRecord(f"message {i} has neither 'role' nor 'from'")
        if not isinstance(content, str):
            raise BadRecord(f"message {i} ({role}) content is {type(content).__name__}, "
                            "not a string")
        out.append((role, content))
    if require_assistant and not any(role == "assistant" for role, _ in out):
        raise BadRecord("no assistant message")
    return out


def encode_conversation(messages, tokenizer: Tokenizer) -> TokenSequence:
    """Tokens and target-aligned loss mask of a conversation in Qwen2.5's ChatML. `messages` is a
    list of {role, content} (system/user/assistant) or ShareGPT {from, value} dicts."""
    pairs = normalize_messages(messages)
    if pairs[0][0] != "system" and tokenizer.default_system is not None:
        pairs.insert(0, ("system", tokenizer.default_system))
    end = [tokenizer.im_end_id] + tokenizer.encode("\n")
    tokens: list[int] = []
    counts: list[bool] = []  # counts[j]: token j is a target that counts
    for role, content in pairs:
        header, body = _header_and_content(role, content, tokenizer)
        is_assistant = role == "assistant"
        tokens += header + body + end
        counts += [False] * len(header) + [is_assistant] * (len(body) + 1)
        counts += [False] * (len(end) - 1)
    return counted_sequence(tokens, counts)


def encode_text(text, tokenizer: Tokenizer) -> TokenSequence:
    """A plain-text record: the tokenizer's BOS where it has one (Llama, Mistral), its tokens, then
    the end of text (<|endoftext|>, the EOS); every target counts."""
    if not isinstance(text, str):
        raise BadRecord(f"text is {type(text).__name__}, not a string")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    tokens = bos + tokenizer.encode(text) + [tokenizer.eod_id]
    return counted_sequence(tokens, [True] * len(tokens))


def encode_tokens(ids, tokenizer: Tokenizer) -> TokenSequence:
    """An already-tokenized document (pretraining style): every target counts. Raises BadRecord when
    an id does not fit the tokenizer's vocabulary (the data was made with another tokenizer)."""
    tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1).copy())
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= tokenizer.vocab_size):
        raise BadRecord(f"token ids span [{int(tokens.min())}, {int(tokens.max())}], outside the "
                        f"vocabulary of {tokenizer.name} (size {tokenizer.vocab_size})")
    mask = torch.ones(tokens.numel(), dtype=torch.float32)
    if tokens.numel():
        mask[-1] = 0
    return TokenSequence(tokens, mask)


def _header_and_content(role: str, content: str, tokenizer: Tokenizer):
    """Token ids of "{role}\\n" and of content. They are taken from encoding "{role}\\n{content}" as
    one string (what the template gives) when the header's ids are a prefix of it. Otherwise (the
    content starts with whitespace and a newline, which merge with the header's newline) each
    piece is encoded on its own, so no token straddles the mask boundary; for an assistant message
    that is also what generation sees, since the prompt ends with the header's newline."""
    header = [tokenizer.im_start_id] + tokenizer.encode(f"{role}\n")
    joint = tokenizer.encode(f"{role}\n{content}")
    n = len(header) - 1
    if joint[:n] == header[1:]:
        return header, joint[n:]
    return header, tokenizer.encode(content)


def counted_sequence(tokens: list[int], counts: list[bool]) -> TokenSequence:
    """TokenSequence whose loss_mask[t] = counts[t + 1] (target-aligned); the last position is 0."""
    assert len(tokens) == len(counts)
    mask = torch.zeros(len(tokens), dtype=torch.float32)
    if len(tokens) > 1:
        mask[:-1] = torch.tensor(counts[1:], dtype=torch.float32)
    return TokenSequence(torch.tensor(tokens, dtype=torch.int64), mask)
