"""load_tokenizer: the default Qwen2.5 vocabulary, local Hugging Face directories, and the errors
that name --tokenizer.

    python -m pytest tests/data/test_tokenizer.py -q
"""

import sys

import pytest

from megatron_chunkflow.data import encode_conversation, load_tokenizer


def test_default_is_cached_qwen25():
    tok = load_tokenizer(None)
    assert load_tokenizer(None) is tok
    assert "qwen2.5" in tok.name
    assert tok.encode("Hello world") == [9707, 1879]  # Qwen2/2.5 ids


def test_missing_directory_names_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer .*nope: no such directory"):
        load_tokenizer(str(tmp_path / "nope"))


def test_directory_without_tokenizer_json_names_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer .*: no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def _write_tiny_hf_tokenizer(directory, specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
    tokenizers = pytest.importorskip("tokenizers", reason="the 'hf' extra (tokenizers) is absent")
    words = ["[UNK]", "system", "user", "assistant", "hello", "there", "you", "are", "qwen"]
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                          unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(list(specials))
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))


def test_hf_directory(tmp_path):
    _write_tiny_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert (tok.eod_id, tok.im_start_id, tok.im_end_id, tok.vocab_size) == (9, 10, 11, 12)
    assert tok.name.startswith("hf:")
    assert tok.encode("hello there") == [4, 5]
    assert tok.im_end_id not in tok.encode("hello <|im_end|>")  # special-token text is text
    seq = encode_conversation([{"role": "user", "content": "hello"},
                               {"role": "assistant", "content": "hello there"}], tok)
    assert seq.tokens.tolist()[-3:] == [4, 5, 11]  # Whitespace drops "\n": no trailing token
    assert int(seq.loss_mask.sum()) == 3


def test_hf_directory_without_chatml_specials(tmp_path):
    _write_tiny_hf_tokenizer(tmp_path / "tok", specials=("<|endoftext|>",))
    with pytest.raises(ValueError, match=r"--tokenizer .*has no special token <\|im_start\|>"):
        load_tokenizer(str(tmp_path / "tok"))


def test_hf_without_tokenizers_package(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ValueError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path))
