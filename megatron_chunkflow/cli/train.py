"""`chunkflow train`: fine-tune a Qwen2.5 / Qwen3 / Llama 3 / Mistral model with ChunkFlow, or with
stock Megatron.

    chunkflow train                                    # the embedded default: tiny model, ShareGPT, CPU
    chunkflow train --no-chunkflow                     # the same run on stock Megatron's path
    torchrun --nproc_per_node 2 -m megatron_chunkflow train --pipeline-model-parallel-size 2
    chunkflow train --data-path sft.jsonl --tokenizer /models/Qwen2.5-7B --model qwen2.5-7b \\
        --seq-length 32768 --chunk-size 8192 --chunkflow-k 2 --global-batch-size 64 \\
        --dtype bfloat16 --save ckpt --save-interval 100 --log-json metrics.jsonl
    chunkflow train --lora-rank 8 --lora-alpha 16 --save-hf out/   # LoRA; --save-hf merges it
    chunkflow train --chunkflow-sparse-backward 2                  # SpaCO: APPROXIMATE gradients

Each step prints loss, tokens/s, model TFLOP/s (attention counted per sequence, recompute not
counted), peak memory and chunks per step; --log-json writes the same as one JSON line per step
(training/metrics.py). The flags come from the settings they fill (mcore/settings.py TrainSettings
checks how they combine); this module only parses them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from megatron_chunkflow.config import RECOMPUTE_MODULES, ChunkFlowConfig, ParallelConfig, Recompute
from megatron_chunkflow.console import Output
from megatron_chunkflow.core.lengths import LengthsConfig
from megatron_chunkflow.core.models import MODEL_SHAPES
from megatron_chunkflow.core.step import BASELINES
from megatron_chunkflow.data.config import DataConfig
from megatron_chunkflow.flags import (
    MAX_COUNT,
    MAX_TOKENS,
    Bounded,
    add_config_arguments,
    config_from_args,
    deprecated_alias,
)
from megatron_chunkflow.mcore.lora import LoRAConfig
from megatron_chunkflow.mcore.settings import (
    add_model_class_argument,
    CheckpointConfig,
    OptimizerConfig,
    TrainSettings,
    model_of,
)
from megatron_chunkflow.runtime.sparse import SparseConfig
from megatron_chunkflow.training.metrics import LogConfig, StepLog

# The embedded scenario (README, "Defaults"): a few minutes on 2 CPU cores, the loss falls from
# ~11.9 (uniform over the Qwen2.5 vocabulary) to ~8-9. Seed 1234 is Megatron-LM's default.
SCENARIO = dict(model="qwen2.5-tiny", train_iters=16, global_batch_size=4, seq_length=32768,
                chunk_size=1024, max_samples=400, lr=1e-2, min_lr=1e-3, lr_warmup_iters=2,
                seed=1234)
MEGATRON_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers",
                      "recompute_modules")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=SCENARIO["model"], choices=sorted(MODEL_SHAPES),
                   help=f"preset (default: {SCENARIO['model']}, Qwen2.5 vocabulary, CPU-sized)")
    g.add_argument("--model-config", metavar="FILE",
                   help="JSON with ModelShape fields, or a Hugging Face config.json (Qwen2/2.5, "
                        "Qwen3, Llama 3.x, Mistral)")
    add_model_class_argument(g)
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32",
                   help="training precision: bfloat16 on a GPU, float64 for exactness checks "
                        "(default: float32)")
    deprecated_alias(g, "--bf16", "--dtype bfloat16", dest="dtype", nargs=0, const="bfloat16")
    deprecated_alias(g, "--fp64", "--dtype float64", dest="dtype", nargs=0, const="float64")
    g = p.add_argument_group("data")
    add_config_arguments(g, DataConfig, default_help={
        "max_samples": f"all; {SCENARIO['max_samples']} of the embedded ShareGPT"})
    g = p.add_argument_group("training (Megatron-LM flags)")
    add_config_arguments(g, ParallelConfig, fields=("tp", "pp", "vpp", "cp", "ep", "etp",
                                                    "sequence_parallel", "recompute"),
                         defaults={"recompute": None}, default_help={"recompute": "none"})
    _megatron_recompute_arguments(g)
    for flag, default, low, high, text in [
        ("--global-batch-size", SCENARIO["global_batch_size"], 1, MAX_COUNT, "sequences per step"),
        ("--seq-length", SCENARIO["seq_length"], 1, MAX_TOKENS, "the longest context trained"),
        ("--train-iters", SCENARIO["train_iters"], 1, MAX_COUNT, "training steps"),
        ("--exit-interval", None, 0, MAX_COUNT, "stop after N steps of this run (then --load "
                                                "resumes; 0, as in Megatron-LM: off)"),
    ]:
        g.add_argument(flag, type=int, action=Bounded, bounds=(low, high), default=default,
                       metavar="N", help=f"{text} (default: {default})")
    add_config_arguments(g, LengthsConfig, fields=("seed",), defaults={"seed": SCENARIO["seed"]})
    add_config_arguments(g, OptimizerConfig, defaults={k: SCENARIO[k] for k in (
        "lr", "min_lr", "lr_warmup_iters")})
    add_config_arguments(g, CheckpointConfig)
    g = p.add_argument_group("chunkflow")
    g.add_argument("--chunkflow", action=argparse.BooleanOptionalAction, default=True,
                   help="ChunkFlow (default) or --no-chunkflow for stock Megatron's path")
    g.add_argument("--baseline", choices=BASELINES, default=None,
                   help="with --no-chunkflow, the stock path: megatron-sft (Megatron-LM's SFT "
                        "as shipped: first-fit packed lines padded to --seq-length), "
                        "megatron-packed (best-fit packing, no padding) or megatron-unpacked "
                        "(one sequence per micro-batch) (default: megatron-packed)")
    add_config_arguments(g, ChunkFlowConfig, defaults={"chunk_size": SCENARIO["chunk_size"]})
    g.add_argument("--chunkflow-skip-memory-check", action="store_true",
                   help="on a GPU, skip the check before step 1 that the first global batch's traced "
                        "memory fits every GPU of the job (memtrace/guard.py)")
    add_config_arguments(g, SparseConfig)
    g = p.add_argument_group("LoRA (adapters on a frozen model)")
    add_config_arguments(g, LoRAConfig, prefix="lora-", defaults={"rank": None},
                         dest_prefix="lora_")
    g = p.add_argument_group("logging")
    add_config_arguments(g, LogConfig)
    g.add_argument("--json", action="store_true", help="print a summary JSON object at the end")


def _megatron_recompute_arguments(g) -> None:
    """Megatron-LM's four recompute flags: still read (with a warning), --recompute is the one
    spelling."""
    for flag, kwargs in (("--recompute-granularity", dict(choices=("full", "selective"))),
                         ("--recompute-method", dict(choices=("uniform", "block"))),
                         ("--recompute-num-layers", dict(type=int)),
                         ("--recompute-modules", dict(nargs="+", choices=RECOMPUTE_MODULES))):
        deprecated_alias(g, flag, "--recompute OPTION", dest=flag[2:].replace("-", "_"),
                         **kwargs)


def settings_from_args(args) -> TrainSettings:
    """The run's settings from the parsed flags (each config checks its own; TrainSettings how
    they combine: ValueError naming the flags)."""
    recompute = args.recompute or Recompute()  # None: not typed
    parallel = config_from_args(ParallelConfig, args, recompute=recompute)
    checkpoint = config_from_args(CheckpointConfig, args)
    checkpoint.check_positions(args.seq_length)
    shape, hf_shape, name = model_of(args.model, args.model_config, checkpoint.load_hf,
                                     parallel.tp)
    megatron_recompute = recompute_from_megatron_flags(args)
    if megatron_recompute is not None:
        if args.recompute is not None:
            raise ValueError("--recompute and Megatron-LM's --recompute-* flags both given; "
                             "give --recompute")
        parallel.check_model(shape)  # PP divides the layers before N is checked against them
        megatron_recompute.check_layers(shape.num_layers // parallel.num_virtual_stages,
                                        "--recompute-num-layers")
        parallel = dataclasses.replace(parallel, recompute=megatron_recompute)
    return TrainSettings(
        shape=shape, model_name=name, system=TrainSettings.system_of(args.chunkflow, args.baseline),
        chunkflow=config_from_args(ChunkFlowConfig, args), parallel=parallel,
        optimizer=config_from_args(OptimizerConfig, args), checkpoint=checkpoint,
        train_iters=args.train_iters, global_batch_size=args.global_batch_size,
        seq_length=args.seq_length, seed=args.seed, exit_interval=args.exit_interval,
        dtype=args.dtype, hf_shape=hf_shape, lora=LoRAConfig.from_args(args),
        sparse=config_from_args(SparseConfig, args),
        memory_check=not args.chunkflow_skip_memory_check,
        model_class=_model_class(args.model_class, checkpoint.load))


def _model_class(model_class: str, load: str | None) -> str:
    """--model-class, "auto" resuming from --load being the checkpoint's class."""
    if model_class != "auto" or not load:
        return model_class
    from megatron_chunkflow.training.checkpoint import model_class_to_resume

    return model_class_to_resume(model_class, load)


def recompute_from_megatron_flags(args) -> Recompute | None:
    """Megatron-LM's four recompute flags as one option of the recompute menu; None if none
    was given."""
    granularity, method, num_layers, modules = (getattr(args, n, None) for n in MEGATRON_RECOMPUTE)
    if all(x is None for x in (granularity, method, num_layers, modules)):
        return None
    if granularity != "selective" and modules is not None:
        raise ValueError("--recompute-modules needs --recompute-granularity selective")
    if granularity != "full" and (method is not None or num_layers is not None):
        raise ValueError("--recompute-method and --recompute-num-layers need "
                         "--recompute-granularity full")
    if granularity == "selective":
        return Recompute("selective", tuple(modules or ("core_attn",)))
    if method == "block":
        if num_layers is None:
            raise ValueError("--recompute-method block needs --recompute-num-layers N")
        return Recompute("block", num_layers=num_layers)
    if num_layers not in (None, 1):
        raise ValueError(f"--recompute-num-layers {num_layers}: uniform recompute runs one "
                         "layer per checkpoint here (use --recompute block:N)")
    return Recompute("full")


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    data = config_from_args(DataConfig, args)
    log_config = config_from_args(LogConfig, args)
    from megatron_chunkflow.data import load_tokenizer, open_sft_dataset
    from megatron_chunkflow.data.sources import is_indexed_prefix
    from megatron_chunkflow.data.tokenizer import DEFAULT_TOKENIZER_NAME
    from megatron_chunkflow.mcore.dist import init_distributed, shutdown
    from megatron_chunkflow.training.checkpoint import SaveFailed
    from megatron_chunkflow.training.loop import Diverged, train

    if s.device == "cpu":  # weights and optimizer states alone past this host's memory
        from megatron_chunkflow.memtrace.guard import check_host_memory, host_memory_of_job

        check_host_memory(s.shape, s.model_name, s.dtype, s.parallel, *host_memory_of_job())
    max_samples = data.max_samples
    if max_samples is None and data.data_path is None:
        max_samples = SCENARIO["max_samples"]
    if data.tokenizer is None and s.shape.family == "llama" and not (
            data.data_path and is_indexed_prefix(data.data_path)):  # text to tokenize
        raise ValueError(f"--model {s.model_name} is a Llama/Mistral-family model and the data "
                         f"would be tokenized by the default {DEFAULT_TOKENIZER_NAME}: give the "
                         "model's own tokenizer (--tokenizer DIR)")
    tokenizer = load_tokenizer(data.tokenizer)
    dataset = open_sft_dataset(data.data_path, tokenizer, seq_length=s.seq_length,
                               overlong=data.overlong, skip_bad_records=data.skip_bad_records,
                               max_samples=max_samples)
    top = dataset.max_token_id
    if top >= s.shape.vocab_size:
        raise ValueError(f"token id {top} does not fit the model's vocabulary of "
                         f"{s.shape.vocab_size} (--model {s.model_name}); the data was tokenized "
                         f"by {tokenizer.name}: give the model's own tokenizer (--tokenizer DIR)")
    job = init_distributed(s.parallel, s.seed)
    rank0 = torch.distributed.get_rank() == 0
    out = Output(args.json, quiet=not rank0)
    p = s.parallel
    c = s.chunkflow
    path = (f"ChunkFlow (C={c.chunk_size}, K={c.num_kept}, state-aware "
            f"{'1F1B' if p.pp > 1 else 'schedule'})" if s.uses_chunkflow else
            f"stock Megatron, {s.system} (micro-batches of up to {s.seq_length} tokens, "
            f"{'1F1B' if p.pp > 1 else 'forward_backward_no_pipelining'}, recompute "
            f"{p.recompute})")
    from megatron_chunkflow import compat

    out.say(f"chunkflow train: {path}; model {s.model_name} ({s.dtype}, "
            f"{'HybridModel' if s.model_class == 'hybrid' else 'GPTModel'} of megatron-core "
            f"{compat.version_text()}), TP={p.tp} "
            + (f"CP={p.cp} " if p.cp > 1 else "") + f"PP={p.pp} "
            f"DP={job.ranks.dp}"
            + (f" EP={p.ep} ETP={p.expert_tp}" if p.ep > 1 else "")
            + f", global batch {s.global_batch_size} sequences, "
            f"{s.train_iters} steps")
    if s.uses_chunkflow:  # a substitution said, not made silently
        from megatron_chunkflow.attention import resolve_backend
        from megatron_chunkflow.attention.lse import ring_fallback

        note = ring_fallback(c, p.cp, resolve_backend(c.attention_backend, s.device))
        if note:
            out.say(note)
    if s.checkpoint.load_hf:
        out.say(f"weights: the Hugging Face checkpoint {s.checkpoint.load_hf}"
                + (" (a later --load checkpoint replaces them)" if s.checkpoint.load else ""))
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
    log = StepLog(log_config, s.train_iters, quiet=not rank0,
                  unit="chunk" if s.uses_chunkflow else "micro-batch")
    try:
        history = train(s, job, dataset, on_step=log)
    except (Diverged, SaveFailed) as e:  # a failed run, not bad usage: exit 1
        if rank0 or isinstance(e, SaveFailed):  # a save may fail on one rank only
            print(f"chunkflow train: error: {e}", file=sys.stderr)
        return 1
    finally:
        log.close()
        shutdown()
    if s.checkpoint.save_hf and rank0:
        _report_hf_export(out, s.checkpoint.save_hf, data.tokenizer, s.checkpoint.load_hf)
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


def _report_hf_export(out, save_hf: str, tokenizer: str | None, load_hf: str | None) -> None:
    """--save-hf: the tokenizer and generation config beside the weights, and where it all went."""
    from megatron_chunkflow.mcore.hf import copy_hf_companions

    copied = copy_hf_companions(save_hf, (tokenizer, load_hf))
    files = ", ".join(["model.safetensors", "config.json", *copied])
    out.say(f"Hugging Face export: {save_hf} ({files})"
            + ("" if "tokenizer.json" in copied else
               "; no tokenizer files to copy (none in --tokenizer or --load-hf; the default "
               "Qwen2.5 vocabulary has none on disk): copy the model's tokenizer.json and "
               "tokenizer_config.json there for AutoTokenizer to load it"))

