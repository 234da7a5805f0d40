"""The tokenizer --data-path records are read with under pretrain_gpt.py: chosen from the tokenizer
Megatron-LM was given (its own chat template, a local Hugging Face directory's ChatML or template,
or token ids only), each refusal naming the flags that would read the data."""

from __future__ import annotations


def data_tokenizer(args, vocab_size: int, megatron_tokenizer=None):
    """The tokenizer for --data-path records, from the tokenizer Megatron was given:
    - one with a chat template of its own (`megatron_tokenizer`, e.g. --tokenizer-type
      SFTTokenizer): conversations through it, with the tokens and loss mask of Megatron's SFT
      dataset (sft.py);
    - --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, a local directory: ChatML where
      it has the ChatML special tokens, else its own chat template, as `chunkflow train` reads
      the same directory (data/tokenizer.py);
    - any other: token ids only.
    Pre-tokenized data (a Megatron indexed dataset) is never encoded, so every tokenizer reads it,
    as in stock Megatron-LM (ids checked against `vocab_size`); text or conversations that the
    tokenizer cannot render stop at the first record, naming the file and the flags that would
    read them."""
    from dataclasses import replace

    from megatron_chunkflow.megatron_lm import sft

    name = _tokenizer_flags(args)
    if sft.has_chat_template(megatron_tokenizer):
        return sft.sft_tokenizer(megatron_tokenizer, vocab_size, name, args.data_path[0])
    tokenizer, why = _chatml_tokenizer(args)
    if tokenizer is not None:
        return replace(tokenizer, name=name)
    return _ids_only_tokenizer(args.data_path[0], name, vocab_size, why)


def _tokenizer_flags(args) -> str:
    """The tokenizer as pretrain_gpt.py's command line named it, for messages and the data line."""
    model = getattr(args, "tokenizer_model", None)
    return f"--tokenizer-type {args.tokenizer_type}" + (f" --tokenizer-model {model}" if model
                                                        else "")


def _chatml_tokenizer(args):
    """(Tokenizer, None) for --tokenizer-type HuggingFaceTokenizer with a local directory that has
    the ChatML special tokens or a chat template; else (None, why not, or None when another type
    was given)."""
    from pathlib import Path

    from megatron_chunkflow.data.tokenizer import load_tokenizer

    if args.tokenizer_type != "HuggingFaceTokenizer":
        return None, None
    model = getattr(args, "tokenizer_model", None)
    if not model or not Path(model).is_dir():
        return None, f"--tokenizer-model {model} is not a local directory"
    try:
        return load_tokenizer(model, flag="--tokenizer-model"), None
    except ValueError as e:
        return None, str(e)


def _ids_only_tokenizer(data_path: str, name: str, vocab_size: int, why: str | None):
    """A Tokenizer that reads token ids (pre-tokenized data) and refuses text, saying which flags
    would tokenize it."""
    from megatron_chunkflow.data.tokenizer import Tokenizer

    def encode(text: str) -> list[int]:
        because = f" ({why})" if why else ""
        raise ValueError(
            f"--data-path {data_path} holds text or conversations, which {name} cannot "
            f"tokenize{because}. Give --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR "
            "(a local directory whose tokenizer.json has <|endoftext|>, <|im_start|>, "
            "<|im_end|>: ChatML, or with a chat template of its own), --tokenizer-type "
            "SFTTokenizer --tokenizer-model DIR "
            "--sft-tokenizer-prompt-format FORMAT (Megatron's SFT template; conversations only), "
            "or pre-tokenized data (a Megatron indexed dataset prefix)")

    return Tokenizer(name=name, vocab_size=vocab_size, eod_id=-1, im_start_id=-1, im_end_id=-1,
                     _encode=encode)
