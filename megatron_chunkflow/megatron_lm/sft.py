"""Conversations through the tokenizer Megatron-LM was given, where it has its own chat template
(`tokenize_conversation`: --tokenizer-type SFTTokenizer --sft-tokenizer-prompt-format FORMAT).

The tokens and loss mask are those of Megatron's SFT dataset (`--sft`), so a run gives the same
targets with and without --chunkflow: a record's `messages` are cut into conversations at each
system message; each is rendered by tokenize_conversation with its targets; where the release's
SFT dataset does (compat.sft_appends_eod: core_v0.16.1), EOD is appended (with itself as target)
unless the template ended with it; a target counts unless it is
IGNORE_INDEX (system and user turns, the assistant prefix) or the tokenizer's pad id. Only what
ChunkFlow never does differs: each conversation is its own sequence, never packed with others,
padded or truncated to --seq-length (--overlong decides).
"""

from __future__ import annotations

from functools import partial

from megatron_chunkflow.data.chat import BadRecord, counted_sequence, normalize_messages
from megatron_chunkflow.data.sequence import TokenSequence
from megatron_chunkflow.data.tokenizer import Tokenizer

MAX_REASON = 300  # characters of a tokenize_conversation error kept in a bad-record message


def has_chat_template(megatron_tokenizer) -> bool:
    """Whether Megatron's tokenizer renders conversations itself (SFTTokenizer, and the
    MultimodalTokenizer of Megatron's multimodal examples; compat.py)."""
    from megatron_chunkflow import compat

    return compat.renders_conversations(megatron_tokenizer)


def sft_tokenizer(megatron_tokenizer, vocab_size: int, name: str, data_path: str) -> Tokenizer:
    """The data layer's Tokenizer for Megatron's `megatron_tokenizer`: conversations through its
    tokenize_conversation; text records stop naming the flags that read them (Megatron's SFT data
    is conversations only, and its tokenizers have no end-of-text convention to copy)."""
    restore_token_ids(megatron_tokenizer)

    def encode(text: str) -> list[int]:
        raise ValueError(
            f"--data-path {data_path} holds text records; {name} reads conversations only "
            "(`messages` records, as Megatron's SFT dataset does). For text give --tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model DIR (a local directory whose tokenizer.json "
            "has <|endoftext|>, <|im_start|>, <|im_end|>) or pre-tokenized data (a Megatron "
            "indexed dataset prefix)")

    eod = megatron_tokenizer.eod
    return Tokenizer(name=name, vocab_size=vocab_size, eod_id=-1 if eod is None else int(eod),
                     im_start_id=-1, im_end_id=-1, _encode=encode,
                     encode_chat=partial(encode_sft_record, megatron_tokenizer, name))


def restore_token_ids(megatron_tokenizer) -> None:
    """Megatron's tokenize_conversation (core_v0.16.1) indexes what the Hugging Face tokenizer's
    apply_chat_template(tokenize=True) returns as the token ids themselves, which is what
    transformers 4 returns; transformers 5 returns a BatchEncoding unless return_dict=False, and
    Megatron's code then fails on every conversation. Asking for return_dict=False gives the ids
    under both versions. Set on this tokenizer object only; idempotent."""
    hf = getattr(megatron_tokenizer, "_tokenizer", None)
    apply = getattr(hf, "apply_chat_template", None)
    if apply is None or getattr(apply, "_chunkflow_ids", False):
        return

    def apply_chat_template(*args, **kwargs):
        kwargs.setdefault("return_dict", False)
        return apply(*args, **kwargs)

    apply_chat_template._chunkflow_ids = True
    hf.apply_chat_template = apply_chat_template


def encode_sft_record(megatron_tokenizer, name: str, messages) -> list[TokenSequence]:
    """The sequences of one record's `messages`, one per conversation (a system message starts a
    new one). Role names and ShareGPT's from/value are checked and mapped as for ChatML; a record
    without an assistant message is kept, as Megatron's SFT dataset keeps it. `name`: the flags
    that chose the tokenizer, for the one error that is not the record's fault."""
    if megatron_tokenizer.eod is None:
        raise ValueError(f"{name}: the tokenizer has no eos_token, which Megatron's SFT data "
                         "ends every conversation with (set eos_token in its "
                         "tokenizer_config.json)")
    pairs = normalize_messages(messages, require_assistant=False)
    turns = [{"role": role, "content": content} for role, content in pairs]
    return [encode_sft_conversation(megatron_tokenizer, c) for c in split_conversations(turns)]


def split_conversations(turns: list[dict]) -> list[list[dict]]:
    """Megatron's SFT records may pack several conversations: each system message starts one."""
    out: list[list[dict]] = []
    for turn in turns:
        if turn["role"] == "system" or not out:
            out.append([])
        out[-1].append(turn)
    return out


def encode_sft_conversation(megatron_tokenizer, conversation: list[dict]) -> TokenSequence:
    """Tokens and target-aligned loss mask of one conversation, as Megatron's SFT dataset makes
    them. Raises BadRecord when tokenize_conversation refuses it (e.g. an empty assistant turn,
    or an assistant turn that does not follow a user turn)."""
    from megatron.training.datasets.sft_dataset import IGNORE_INDEX

    try:
        tokens, targets = megatron_tokenizer.tokenize_conversation(
            conversation, return_target=True, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001  Megatron raises ValueError, AssertionError, jinja errors
        raise BadRecord(f"{type(megatron_tokenizer).__name__}.tokenize_conversation refused this "
                        f"conversation: {_reason(e)}") from None
    from megatron_chunkflow import compat

    tokens, targets = [int(t) for t in tokens], [int(t) for t in targets]
    eod = int(megatron_tokenizer.eod)
    if compat.sft_appends_eod() and (not tokens or tokens[-1] != eod):
        tokens.append(eod)
        targets.append(eod)
    pad = getattr(megatron_tokenizer, "pad", None)
    return counted_sequence(tokens, [t != IGNORE_INDEX and t != pad for t in targets])


def _reason(e: Exception) -> str:
    """A one-line, bounded account of an exception (Megatron's messages repeat the whole
    conversation; its role-order check is a bare assert)."""
    text = " ".join(str(e).split())
    if not text and isinstance(e, AssertionError):
        text = "its checks failed (an assistant message must follow a user message)"
    if len(text) > MAX_REASON:
        text = text[:MAX_REASON] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
