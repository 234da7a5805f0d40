"""Which tokenizer reads which --data-path through the launcher (pretrain_gpt.py, core_v0.16.1).

- A Megatron indexed dataset is pre-tokenized: any tokenizer flags read it, as in stock Megatron-LM.
- Conversations with a tokenizer that cannot render them stop with pretrain_gpt.py's flags named.
- --tokenizer-type SFTTokenizer (Megatron's SFT template, --sft's data): the same tokens and loss
  mask as Megatron's SFT dataset, checked against Megatron's own SFTDataset and tokenize_conversation.

Stock `pretrain_gpt.py --sft` itself cannot run on CPU: its SFTDataset returns packed THD batches
(cu_seqlens), which only Transformer Engine's attention takes (--transformer-impl local asserts
packed_seq_params is None). So the reference is Megatron's SFTDataset.__getitem__ run in a child
process, and the launcher's loss is checked against a Hugging Face forward over those targets.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megatron_chunkflow.data import encode_tokens, open_sft_dataset
from megatron_chunkflow.megatron_lm.tokenizers import data_tokenizer
from tests.megatron_lm import test_pretrain_gpt as launcher_tests
from tests.megatron_lm.test_pretrain_gpt import (
    CPU,
    MEGATRON_LM,
    MODEL,
    SCHEDULE,
    _chat_corpus,
    _flags,
    _launch_one,
    _megatron_losses,
    _torchrun,
    needs_megatron_lm,
    without,
)

workdir = launcher_tests.workdir  # the fixture: a tiny Qwen2 checkpoint and an indexed corpus

SFT_WORDS = ["<unk>", "\n", "System", "User", "Assistant", "hello", "there", "you", "are", "qwen"]
SFT_SPECIALS = ["<|endoftext|>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]


def _word_tokenizer(directory: Path, words: list[str], specials: list[str], eos: str) -> None:
    """A word-level Hugging Face tokenizer that keeps "\\n" as a token (as real BPE vocabularies
    do), saved with the tokenizer_config.json that AutoTokenizer needs."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)},
                                                           unk_token=words[0]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split("\n", "isolated"),
        tokenizers.pre_tokenizers.Split(tokenizers.Regex("[ \t]+"), "removed")])
    tok.add_special_tokens(specials)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": words[0]}))


def _no_chatml_tokenizer(directory: Path) -> None:
    """1000 plain words (the indexed corpus's ids) and an end-of-text token, no ChatML tokens."""
    _word_tokenizer(directory, ["[UNK]"] + [f"w{i}" for i in range(1, 1000)], ["</s>"], "</s>")


def _hf_args(model, data_path, tokenizer_type="HuggingFaceTokenizer"):
    return types.SimpleNamespace(tokenizer_type=tokenizer_type, tokenizer_model=model,
                                 data_path=[data_path])


# ---- item: pre-tokenized data takes any tokenizer; conversations name pretrain_gpt.py's flags ----


def test_indexed_ids_need_no_chatml_tokens(tmp_path):
    """An HF tokenizer without <|im_start|>/<|im_end|> still reads token ids."""
    _no_chatml_tokenizer(tmp_path / "tok")
    tok = data_tokenizer(_hf_args(str(tmp_path / "tok"), "corpus"), 1000)
    assert encode_tokens([1, 999, 5], tok).tokens.tolist() == [1, 999, 5]


@pytest.mark.parametrize("model", ["tok", "missing", None])
def test_conversations_without_a_usable_tokenizer_name_megatron_flags(tmp_path, model):
    """Text/conversations with a tokenizer that cannot render them: the file and pretrain_gpt.py's
    flags are named, never `chunkflow train`'s --tokenizer."""
    _no_chatml_tokenizer(tmp_path / "tok")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"},
                                             {"role": "assistant", "content": "w2"}]}) + "\n")
    path = None if model is None else str(tmp_path / model)
    args = _hf_args(path, str(data), "HuggingFaceTokenizer" if model else "NullTokenizer")
    with pytest.raises(ValueError) as e:
        open_sft_dataset(str(data), data_tokenizer(args, 1000), seq_length=64)
    message = str(e.value)
    assert str(data) in message
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR" in message
    assert "--tokenizer-type SFTTokenizer" in message
    assert "--tokenizer " not in message and "omit --tokenizer" not in message
    if model == "tok":
        assert "no special token" in message and "<|im_start|>" in message
    if model == "missing":
        assert "is not a local directory" in message


@needs_megatron_lm
@pytest.mark.slow
def test_indexed_data_with_any_hf_tokenizer_trains(workdir):
    """Stock Megatron-LM reads an indexed dataset with any tokenizer; so does --chunkflow. A
    conversation file with the same tokenizer stops (exit 2) naming the flags and the file."""
    if not (workdir / "tok1000").exists():
        _no_chatml_tokenizer(workdir / "tok1000")
    if not (workdir / "chat.jsonl").exists():
        _chat_corpus(workdir)
    cpu = [*without(CPU, "--tokenizer-type", "--vocab-size"), "--tokenizer-type",
           "HuggingFaceTokenizer", "--tokenizer-model", "tok1000"]
    args = [*MODEL, *cpu, *_flags({**SCHEDULE, "--train-iters": 2}), "--micro-batch-size", "1",
            "--chunkflow", "--chunkflow-load-hf", "hf"]
    run = _launch_one(workdir, [*args, "--data-path", "corpus"], timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert len(_megatron_losses(run.stdout)) == 2
    chat = _launch_one(workdir, [*args, "--data-path", "chat.jsonl"], timeout=300)
    assert chat.returncode == 2, chat.stdout[-3000:] + chat.stderr[-3000:]
    assert "Traceback" not in chat.stderr
    err = chat.stderr
    assert "chunkflow-megatron: error: --data-path chat.jsonl" in err
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR" in err
    assert "no special token" in err and "<|im_start|>" in err and "--tokenizer " not in err


# ---- item: --tokenizer-type SFTTokenizer gives Megatron's SFT tokens and loss mask ----------------


def _sft_corpus(directory: Path) -> int:
    """sft_tok/ (the specials of Megatron's nemotron SFT templates), hf_sft/ (a Qwen2 checkpoint
    of its vocabulary) and sft.jsonl in Megatron's SFT format ({"messages": [...]}, several
    conversations per record where a system message starts a new one). Returns the number of
    conversations."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _word_tokenizer(directory / "sft_tok", SFT_WORDS, SFT_SPECIALS, "<|endoftext|>")
    config = Qwen2Config(hidden_size=64, num_hidden_layers=4, intermediate_size=176,
                         num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=len(SFT_WORDS) + len(SFT_SPECIALS), tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6, dtype=torch.float32)
    torch.manual_seed(2)
    Qwen2ForCausalLM(config).save_pretrained(directory / "hf_sft")
    g = torch.Generator().manual_seed(2)

    def words(n):
        return " ".join(SFT_WORDS[5 + int(j)] for j in torch.randint(0, 5, (n,), generator=g))

    def turn(role, n):
        return {"role": role, "content": words(n)}

    records = [
        [turn("system", 3), turn("user", 4), turn("assistant", 9)],
        [turn("user", 2), turn("assistant", 5), turn("user", 3), turn("assistant", 40)],
        [turn("system", 2), turn("user", 2), turn("assistant", 3),
         turn("system", 4), turn("user", 6), turn("assistant", 7), turn("user", 1),
         turn("assistant", 2)],
        # an unknown word: <unk>, which is nemotron-nano-v2's pad id, so Megatron masks it
        [turn("user", 3), {"role": "assistant", "content": "hello banana there"}],
        [turn("system", 1), turn("user", 30), turn("assistant", 200)],
        [turn("user", 5), {"role": "assistant", "content": "  qwen  you \n are "}],
    ]
    with (directory / "sft.jsonl").open("w") as f:
        for messages in records:
            f.write(json.dumps({"messages": messages}) + "\n")
    return sum(1 + sum(m["role"] == "system" for m in r[1:]) for r in records)


# Runs in a child process (megatron/training needs the CPU shims, which change torch.cuda):
# Megatron's SFTTokenizer and SFTDataset.__getitem__ on the JSONL, each packed sample cut into
# its conversations at cu_seqlens; the plugin's reading of the same file; and, given a Hugging
# Face checkpoint, the mean cross entropy over Megatron's targets.
_CHILD = r"""
import json, sys, types
from megatron_chunkflow import compat
from megatron_chunkflow.megatron_lm.cpu import install_megatron_lm_cpu_shims
install_megatron_lm_cpu_shims()
compat.backport_typing_override()
import megatron.core  # the installed megatron-core before the checkout's copy
megatron_lm, tok_dir, fmt, data, hf_dir = sys.argv[1:6]
sys.path.append(megatron_lm)
import numpy as np, torch
from megatron.training.datasets.sft_dataset import SFTDataset
try:  # core_v0.16.1: Megatron-LM's own
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer
except ImportError:  # 0.17 on: megatron-core's, as megatron/training builds it
    from megatron.core.tokenizers import MegatronTokenizer

    def SFTTokenizer(path, prompt_format):
        return MegatronTokenizer.from_pretrained(tokenizer_path=path,
                                                 metadata_path={"library": "sft"},
                                                 prompt_format=prompt_format)

tok = SFTTokenizer(tok_dir, fmt)
hf = tok._tokenizer
if hasattr(hf, "apply_chat_template"):  # core_v0.16.1 indexes what transformers 5 returns (a
    apply = hf.apply_chat_template      # BatchEncoding) as the ids; 0.17 on extracts them
    hf.apply_chat_template = lambda *a, **k: apply(*a, **{"return_dict": False, **k})
records = [json.loads(line)["messages"] for line in open(data)]
ds = object.__new__(SFTDataset)
ds.dataset, ds.indices = records, np.arange(len(records))
ds.config = types.SimpleNamespace(
    tokenizer=tok, sequence_length=4096, context_parallel_size=1, reset_position_ids=False,
    create_attention_mask=False, reset_attention_mask=False)
segments = []
for i in range(len(records)):
    item = ds[i]
    cu = item["cu_seqlens"].tolist()
    while len(cu) > 2 and cu[-1] == cu[-2]:  # 0.19 pads cu_seqlens with the pack's length
        cu.pop()
    last = ds._split_conversations(records[i])[-1]  # where the last conversation ends: padding
    n = len(tok.tokenize_conversation(last, return_target=True, add_generation_prompt=False)[0])
    if compat.sft_appends_eod():  # core_v0.16.1 ends each conversation with EOD
        n = int(np.nonzero(item["tokens"].numpy() == tok.eod)[0][-1]) + 1 - cu[-2]
    end = cu[-2] + n
    assert (item["tokens"][end:] == tok.pad).all()
    bounds = cu[:-1] + [end]
    for a, b in zip(bounds[:-1], bounds[1:]):
        segments.append({k: item[k][a:b] for k in ("tokens", "labels", "loss_mask")})
out = {"megatron": [[s["tokens"].tolist(), s["loss_mask"].tolist()] for s in segments]}

from megatron_chunkflow.data import open_sft_dataset
from megatron_chunkflow.megatron_lm.tokenizers import data_tokenizer
args = types.SimpleNamespace(tokenizer_type="SFTTokenizer", tokenizer_model=tok_dir,
                             data_path=[data])
ours = open_sft_dataset(data, data_tokenizer(args, tok.vocab_size, SFTTokenizer(tok_dir, fmt)),
                        seq_length=4096)
out["ours"] = [[ours[i].tokens.tolist(), ours[i].loss_mask.tolist()] for i in range(len(ours))]
if hf_dir:
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in segments:
            logits = model(s["tokens"][None]).logits[0].double()
            ce = torch.nn.functional.cross_entropy(logits, s["labels"].clamp(min=0),
                                                   reduction="none")
            total += float((ce * s["loss_mask"]).sum())
            count += int(s["loss_mask"].sum())
    out["loss"] = total / count
print("RESULT " + json.dumps(out))
"""


def _megatron_sft_reference(directory: Path, prompt_format: str, hf: str = "") -> dict:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(MEGATRON_LM), "sft_tok",
                          prompt_format, "sft.jsonl", hf], cwd=directory, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@needs_megatron_lm
@pytest.mark.slow
@pytest.mark.parametrize("prompt_format", ["nemotron-h-aligned", "nemotron-nano-v2"])
def test_sft_tokenizer_matches_megatron_sft_dataset(tmp_path, prompt_format):
    """Token ids and loss mask of every conversation equal Megatron's SFTDataset's (its template,
    IGNORE_INDEX prompts, the appended EOD target, pad-id targets masked), one sequence per
    conversation."""
    pytest.importorskip("transformers")
    n = _sft_corpus(tmp_path)
    got = _megatron_sft_reference(tmp_path, prompt_format)
    assert len(got["megatron"]) == n
    assert got["ours"] == got["megatron"]
    masks = [m for _, m in got["megatron"]]
    assert all(0 < sum(m) < len(m) for m in masks)  # prompts masked, replies counted
    if prompt_format == "nemotron-nano-v2":  # "banana" is <unk> = the pad id: not a target
        tokens, mask = got["megatron"][4]
        assert tokens.count(0) == 1 and mask[tokens.index(0) - 1] == 0


@needs_megatron_lm
@pytest.mark.slow
def test_sft_tokenizer_step_loss_equals_megatron_sft_targets(workdir):
    """pretrain_gpt.py --sft --tokenizer-type SFTTokenizer --chunkflow: the first step's loss (the
    whole file in one global batch) is the mean cross entropy over exactly the targets of
    Megatron's SFT dataset, at the same Hugging Face weights; another template or mask would move
    it."""
    pytest.importorskip("transformers")
    if not (workdir / "sft.jsonl").exists():
        _sft_corpus(workdir)
    reference = _megatron_sft_reference(workdir, "nemotron-nano-v2", "hf_sft")
    conversations, expected = len(reference["megatron"]), reference["loss"]
    cpu = [*without(CPU, "--tokenizer-type", "--vocab-size"), "--tokenizer-type",
           "SFTTokenizer", "--tokenizer-model", "sft_tok",
           "--sft-tokenizer-prompt-format", "nemotron-nano-v2"]
    sched = {**SCHEDULE, "--train-iters": 1, "--lr-warmup-iters": 0,
             "--global-batch-size": conversations}
    run = _torchrun(1, ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL,
                        *cpu, *_flags(sched), "--micro-batch-size", "1", "--sft", "--data-path",
                        "sft.jsonl", "--chunkflow", "--chunkflow-load-hf", "hf_sft"], workdir)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{conversations} sequences" in run.stdout
    assert "--sft: " in run.stdout and "SFTTokenizer" in run.stdout
    assert _megatron_losses(run.stdout) == pytest.approx([expected], rel=1e-5)
