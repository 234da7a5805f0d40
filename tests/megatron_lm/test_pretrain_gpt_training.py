"""What the shipped jobs run, through Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1) with the
plugin, on CPU with gloo: configs/runs/common.sh's optimizer flags against stock and against
Megatron's plain DDP path, the metrics in TensorBoard, and validation under --chunkflow.

Needs a Megatron-LM checkout, as test_pretrain_gpt.py (whose fixture and helpers these share).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from tests.megatron_lm import test_pretrain_gpt as launcher_tests
from tests.megatron_lm.test_pretrain_gpt import (
    CPU,
    MEGATRON_LM,
    MODEL,
    ROOT,
    SCHEDULE,
    SEQ,
    C,
    _flags,
    _megatron_losses,
    _torchrun,
    needs_megatron_lm,
    without,
)

workdir = launcher_tests.workdir  # the fixture: a tiny Qwen2 checkpoint and an indexed corpus


def _shipped_training_args(iters: int) -> list[str]:
    """configs/runs/common.sh's COMMON_TRAINING_ARGS (every shipped SLURM job's optimizer,
    precision and overlap flags) as the file sets them."""
    out = subprocess.run(["bash", "-c", 'source "$0"; printf "%s\\n" "${COMMON_TRAINING_ARGS[@]}"',
                          str(ROOT / "configs" / "runs" / "common.sh")], capture_output=True,
                         text=True, check=True, env={**os.environ, "TRAIN_ITERS": str(iters)})
    return out.stdout.splitlines()


def _grad_norms(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"\| grad norm: ([0-9.E+-]+) \|", log)]


@needs_megatron_lm
@pytest.mark.slow
def test_shipped_run_flags_train_under_chunkflow(workdir):
    """The shipped jobs' flags (bf16, --use-distributed-optimizer, --overlap-grad-reduce,
    --overlap-param-gather, per-token loss, clipping) with --chunkflow at DP 2: the same losses and
    grad norms as with Megatron's plain DDP and optimizer (whose losses the test above ties to
    `chunkflow train`); stock Megatron-LM runs the same flags on the same corpus."""
    shipped = _shipped_training_args(iters=3)
    for flag in ("--use-distributed-optimizer", "--overlap-param-gather", "--bf16"):
        assert flag in shipped
    cpu = without(CPU, "--eval-iters", "--log-interval")
    base = ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL, *cpu,
            "--seq-length", str(SEQ), "--global-batch-size", "8", "--seed", "1234",
            "--data-path", "corpus", "--split", "100,0,0"]
    chunkflow = ["--chunkflow", "--chunk-size", str(C), "--chunkflow-k", "1"]
    overlap = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    tensorboard = workdir / "tensorboard_shipped"
    runs = {"shipped": _torchrun(2, [*base, *shipped, *chunkflow, "--tensorboard-dir",
                                     str(tensorboard)], workdir),
            "plain": _torchrun(2, [*base, *(f for f in shipped if f not in overlap), *chunkflow],
                               workdir),
            "stock": _torchrun(2, [*base, *shipped], workdir)}
    for name, run in runs.items():
        assert run.returncode == 0, name + ": " + run.stdout[-3000:] + run.stderr[-3000:]
        assert len(_megatron_losses(run.stdout)) == 3 and len(_grad_norms(run.stdout)) == 3, name
    shipped_log, plain_log = runs["shipped"].stdout, runs["plain"].stdout
    assert _megatron_losses(shipped_log) == _megatron_losses(plain_log)
    assert _grad_norms(shipped_log) == _grad_norms(plain_log)
    assert "[chunkflow] iteration 3" in shipped_log and "[chunkflow]" not in runs["stock"].stdout
    # the [chunkflow] line's metrics also reach Megatron-LM's TensorBoard writer
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("chunkflow/")]
    assert {"chunkflow/tokens_per_sec_per_gpu", "chunkflow/model_tflops_per_gpu",
            "chunkflow/peak_memory_gib", "chunkflow/reforwarded_fraction"} <= set(tags)
    tokens = [int(t) for t in re.findall(r"\[chunkflow\] iteration \d+ \| tokens (\d+) ",
                                          shipped_log)]
    logged = events.Scalars("chunkflow/tokens")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [int(e.value) for e in logged] == tokens


def _write_corpus(prefix, documents) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for ids in documents:
        builder.add_item(torch.as_tensor(ids))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@needs_megatron_lm
@pytest.mark.slow
def test_shipped_flags_step_one_equals_stock(workdir):
    """Stock Megatron-LM and --chunkflow with the shipped jobs' optimizer flags (distributed
    optimizer, overlapped reduce and gather; float32 here) see the same sequences: 9 documents of
    exactly --seq-length tokens ending in EOD, so stock's rows are whole documents (the extra token
    a row reads is the next document's first, its loss masked by --eod-mask-loss), and ChunkFlow
    gets the 8 that stock's first epoch holds (read from stock's own document index) as one global
    batch, cut into dependent chunks. Step 1's loss and grad norm (forward, backward, the DP
    reduction of the distributed optimizer) are stock's."""
    import glob

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    seq, g = 256, torch.Generator().manual_seed(3)
    documents = [torch.randint(0, 999, (seq,), generator=g) for _ in range(9)]
    for ids in documents:
        ids[-1] = 999  # NullTokenizer(999)'s EOD
    _write_corpus(workdir / "rows9", documents)
    shipped = [f for f in _shipped_training_args(iters=1) if f != "--bf16"]
    cpu = without(CPU, "--eval-iters", "--log-interval")
    base = ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL, *cpu,
            *shipped, "--seq-length", str(seq), "--global-batch-size", "8", "--seed", "1234",
            "--split", "100,0,0", "--make-vocab-size-divisible-by", "8",  # 1000 rows, no padding
            "--chunkflow-load-hf", "hf"]
    stock = _torchrun(2, [*base, "--data-path", "rows9", "--eod-mask-loss"], workdir)
    assert stock.returncode == 0, stock.stdout[-3000:] + stock.stderr[-3000:]
    index = glob.glob(str(workdir / "rows9" / "cache" / "**" / "*train-document_index.npy"),
                      recursive=True)
    assert len(index) == 1, index
    order = np.load(index[0])
    assert sorted(order) == list(range(9))  # one epoch: 8 rows, the last document unread
    corpus = IndexedDataset(str(workdir / "rows9"))
    _write_corpus(workdir / "rows8", [corpus[int(d)] for d in order[:8]])
    chunkflow = _torchrun(2, [*base, "--data-path", "rows8", "--chunkflow", "--chunk-size", "128",
                              "--no-rope-fusion"], workdir)
    assert chunkflow.returncode == 0, chunkflow.stdout[-3000:] + chunkflow.stderr[-3000:]
    assert "chunks 16 |" in chunkflow.stdout  # every document in two dependent chunks
    assert _megatron_losses(chunkflow.stdout) == _megatron_losses(stock.stdout)
    assert _grad_norms(chunkflow.stdout) == _grad_norms(stock.stdout)
    assert len(_megatron_losses(stock.stdout)) == 1


def _hf_loss(workdir, documents) -> float:
    """transformers' per-token loss (float64) of the Hugging Face checkpoint over `documents` of
    the indexed corpus: every next-token target of every document counts once."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import Qwen2ForCausalLM

    corpus = IndexedDataset(str(workdir / "corpus"))
    model = Qwen2ForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float64).eval()
    total = targets = 0
    with torch.no_grad():
        for i in documents:
            ids = torch.tensor(corpus[i], dtype=torch.long)[None]
            logits = model(ids).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            targets += ids.shape[1] - 1
    return total / targets


@needs_megatron_lm
@pytest.mark.slow
def test_validation_runs_chunked_on_the_split(workdir):
    """--eval-iters/--eval-interval under --chunkflow: --split 50,50,0 holds out documents 8-15
    (as Megatron-LM splits documents), validation runs them in dependent chunks forward-only, and
    at a learning rate of 0 with the whole split in one global batch both losses are
    transformers' on those documents."""
    cpu = without(CPU, "--eval-iters", "--eval-interval")
    sched = {**SCHEDULE, "--train-iters": 2, "--global-batch-size": 8, "--lr": "0",
             "--min-lr": "0", "--lr-warmup-iters": 0}
    run = _torchrun(2, ["megatron_chunkflow.launch", str(MEGATRON_LM / "pretrain_gpt.py"), *MODEL,
                        *cpu, *_flags(sched), "--micro-batch-size", "1", "--data-path", "corpus",
                        "--split", "50,50,0", "--eval-iters", "1", "--eval-interval", "2",
                        "--chunkflow", "--chunkflow-load-hf", "hf"], workdir)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "8 training sequences (--split 50,50,0 of 16); validation: 8 sequences" in run.stdout
    valid = [float(x) for x in re.findall(r"validation loss at iteration 2 \| lm loss value: "
                                          r"([0-9.E+-]+)", run.stdout)]
    assert valid == pytest.approx([_hf_loss(workdir, range(8, 16))], rel=1e-5)
    assert _megatron_losses(run.stdout) == pytest.approx([_hf_loss(workdir, range(8))] * 2,
                                                         rel=1e-5)
