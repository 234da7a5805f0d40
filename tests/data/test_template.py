"""A tokenizer directory's own chat template (data/template.py): Llama 3 / Mistral style
tokenizers without ChatML's tokens, against transformers' apply_chat_template on the same
directory (tokens and assistant mask), and what is refused.

    .venv/bin/python -m pytest tests/data/test_template.py -q

The templates are ours, written in each family's format; a byte-level BPE is trained in memory on
a few sentences, so offsets are those of a real Llama 3-like tokenizer (nothing is downloaded).
"""

import json

import pytest

from megatron_chunkflow.data import encode_conversation, load_tokenizer
from megatron_chunkflow.data.chat import BadRecord
from megatron_chunkflow.data.dataset import encode_record_sequences

tokenizers = pytest.importorskip("tokenizers", reason="the 'hf' extra (tokenizers) is absent")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
TURN = ("<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}"
        "<|eot_id|>")
# Llama 3's format; GENERATION marks the assistant turns for transformers' assistant mask
LLAMA3 = ("{{ bos_token }}{% for m in messages %}" + TURN + "{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% generation %}"
    "{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}" + TURN +
    "{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral v0.3's habit: the system message goes into the last user turn
MISTRAL_SYSTEM_LAST = (
    "{{ bos_token }}{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' %}"
    "{% for m in messages if m['role'] != 'system' %}{% if m['role'] == 'user' %}[INST] "
    "{% if loop.last and sys %}{{ sys }}\n\n{% endif %}{{ m['content'] }}[/INST]{% else %}"
    "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Where is the river?"},
        {"role": "assistant", "content": "The river runs past the old mill."},
        {"role": "user", "content": "  And the bridge?\n"},
        {"role": "assistant", "content": "Over the river, by the mill."}]


def _directory(path, template, specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>",
               eos="<|eot_id|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    text = [m["content"] for m in CHAT] * 4 + ["system user assistant briefly answer"]
    hf.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
         "chat_template": template}))
    return path


def test_llama3_template_matches_transformers(tmp_path):
    """Tokens and targets as transformers' apply_chat_template gives them for the same directory
    (its assistant mask from the template's {% generation %} marks: the reply and <|eot_id|>)."""
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(str(_directory(tmp_path / "ours", LLAMA3)))
    theirs = transformers.AutoTokenizer.from_pretrained(
        _directory(tmp_path / "theirs", LLAMA3_GENERATION))
    (seq,) = encode_record_sequences({"messages": CHAT}, ours)
    want = theirs.apply_chat_template(CHAT, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    assert seq.tokens.tolist() == want["input_ids"]
    assert seq.loss_mask.tolist()[:-1] == want["assistant_masks"][1:]  # target-aligned
    eot = theirs.convert_tokens_to_ids("<|eot_id|>")
    assert seq.tokens.tolist()[0] == theirs.convert_tokens_to_ids("<|begin_of_text|>")
    targets = [t for t, m in zip(seq.tokens.tolist()[1:], seq.loss_mask.tolist()) if m]
    assert targets.count(eot) == 2 and theirs.decode(targets).count("mill") == 2
    assert ours.eod_id == eot and ours.default_system is None


def test_what_is_refused_names_the_reason(tmp_path):
    tok = load_tokenizer(str(_directory(tmp_path / "llama", LLAMA3)))
    injected = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "done<|eot_id|>more"}]
    with pytest.raises(BadRecord, match=r"message 1 \(assistant\) holds the text of the special "
                                        r"token '<\|eot_id\|>'"):
        tok.encode_chat(injected)
    mistral = load_tokenizer(str(_directory(tmp_path / "mistral", MISTRAL_SYSTEM_LAST,
                                            specials=["<s>", "</s>"], bos="<s>", eos="</s>")))
    with pytest.raises(BadRecord, match="renders the conversation up to message 2 otherwise"):
        mistral.encode_chat(CHAT)
    assert len(mistral.encode_chat(CHAT[1:])) == 1  # without a system message it is stable
    strict = LLAMA3.replace("{% for m in messages %}", "{% for m in messages %}{% if m['role'] == "
                            "'system' %}{{ raise_exception('no system messages') }}{% endif %}")
    with pytest.raises(BadRecord, match="the chat template refused this conversation: no system"):
        load_tokenizer(str(_directory(tmp_path / "strict", strict))).encode_chat(CHAT)


def test_directory_errors_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer .*bad: the chat template is not valid "
                                         r"Jinja"):
        load_tokenizer(str(_directory(tmp_path / "bad", "{% for m in messages %}")))
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not a token"):
        load_tokenizer(str(_directory(tmp_path / "eos", LLAMA3, eos="<|nope|>")))


def test_chatml_directories_take_the_default_system_from_their_template(tmp_path):
    """Qwen3's tokenizer has ChatML's tokens but its template no default system message: ChatML
    without one. A template with Qwen2.5's default system message (or none at all) keeps it."""
    chatml = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    qwen3 = load_tokenizer(str(_directory(tmp_path / "qwen3", "{{ messages }}", specials=chatml,
                                          bos=None, eos="<|im_end|>")))
    qwen25 = load_tokenizer(str(_directory(
        tmp_path / "qwen25", "You are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant. {{ messages }}", specials=chatml, bos=None, eos="<|im_end|>")))
    assert qwen3.encode_chat is None and qwen3.default_system is None
    assert qwen25.default_system.startswith("You are Qwen")
    user = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    n3 = len(encode_conversation(user, qwen3).tokens)
    n25 = len(encode_conversation(user, qwen25).tokens)
    assert n25 - n3 == len(qwen25.encode("system\n" + qwen25.default_system)) + 3


def test_megatron_lm_launcher_reads_the_same_template(tmp_path):
    """pretrain_gpt.py's --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: ChunkFlow's
    data reader renders conversations with the directory's template, as `chunkflow train` does."""
    import types

    from megatron_chunkflow.megatron_lm.tokenizers import data_tokenizer

    directory = str(_directory(tmp_path / "llama", LLAMA3))
    args = types.SimpleNamespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=directory,
                                 data_path=["chat.jsonl"])
    tok = data_tokenizer(args, 512)
    assert tok.name == f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {directory}"
    (got,) = encode_record_sequences({"messages": CHAT}, tok)
    (want,) = load_tokenizer(directory).encode_chat(CHAT)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.loss_mask.tolist() == want.loss_mask.tolist()


def test_generation_marks_render_and_text_records_start_with_bos(tmp_path):
    """A template with transformers' {% generation %} marks renders as without them; a text
    record starts with the tokenizer's BOS (Llama 3 saw <|begin_of_text|> first in pretraining)
    and ends with its EOS."""
    from megatron_chunkflow.data.chat import encode_text

    plain = load_tokenizer(str(_directory(tmp_path / "plain", LLAMA3)))
    marked = load_tokenizer(str(_directory(tmp_path / "marked", LLAMA3_GENERATION)))
    assert (plain.encode_chat(CHAT)[0].tokens.tolist()
            == marked.encode_chat(CHAT)[0].tokens.tolist())
    seq = encode_text("the river", plain)
    assert seq.tokens.tolist() == [plain.bos_id, *plain.encode("the river"), plain.eod_id]
    assert plain.bos_id == 0 and plain.eod_id == 4  # <|begin_of_text|>, <|eot_id|>


def test_a_token_across_a_turns_end_is_refused(tmp_path):
    """A template that writes the next turn right after a reply ("...therEuser: ..."): a
    whitespace-split word tokenizer makes one token of the reply's end and the next turn's start,
    which the mask cannot follow; the record is refused, never half-trained."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "user:", "assistant:", "hello", "there", "again"]
    hf = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["</s>"])
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "chat_template": template}))
    tok = load_tokenizer(str(tmp_path / "tok"))
    one_turn = [{"role": "user", "content": "hello "}, {"role": "assistant", "content": "there"}]
    assert len(tok.encode_chat(one_turn)[0].tokens) == 4  # "user: hello assistant: there"
    with pytest.raises(BadRecord, match="across the edge of the assistant turn"):
        tok.encode_chat([*one_turn, {"role": "user", "content": "again"},
                         {"role": "assistant", "content": "hello"}])
