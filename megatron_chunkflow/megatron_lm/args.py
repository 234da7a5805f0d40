"""The plugin's flags in Megatron-LM's parser, and their checks against Megatron's own flags.

    --chunkflow --chunk-size 8192 --chunkflow-k 2 [--chunkflow-attention-backend auto]

Everything that cannot work with ChunkFlow stops here with a message naming the flags, before any
model is built. A few Megatron settings ChunkFlow needs are set for the user, each announced:
`--dataloader-type external` (the step iterator) and `--calculate-per-token-loss` (a chunk's loss
is a sum over its tokens; the step's loss is the mean over every target token of the global batch).
"""

from __future__ import annotations

import argparse

from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.core.profiles import PROFILES
from megatron_chunkflow.data.config import DataConfig
from megatron_chunkflow.data.sources import check_data_path
from megatron_chunkflow.flags import add_config_arguments, config_from_args, flag_errors

# Megatron-LM has its own --attention-backend: ours lives in the chunkflow namespace, as every
# destination of the plugin's flags does (args.chunkflow_chunk_size, args.chunkflow_num_kept, ...).
FLAGS = {"attention_backend": "--chunkflow-attention-backend"}
DEST_PREFIX = "chunkflow_"


class LaunchError(ValueError):
    """Bad flags or data for a Megatron-LM run with the plugin: the launcher prints it and exits 2."""


def add_chunkflow_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("ChunkFlow (megatron_chunkflow)")
    g.add_argument("--chunkflow", action="store_true",
                   help="train with ChunkFlow: sequences cut into dependent chunks and packed into "
                        "chunks of --chunk-size tokens, run by the state-aware 1F1B schedule; "
                        "--global-batch-size counts sequences. Without it the script is stock")
    add_config_arguments(g, ChunkFlowConfig, flags=FLAGS, dest_prefix=DEST_PREFIX, aliases=False)
    g.add_argument("--chunkflow-mock-profile", choices=sorted(PROFILES), default="B",
                   help="with --mock-data: the length profile (docs/design.md), scaled so its "
                        "longest sequence is --seq-length (default: B)")
    add_config_arguments(g, DataConfig, fields=("overlong", "skip_bad_records"), aliases=False)
    g.add_argument("--chunkflow-load-hf", metavar="DIR",
                   help="initialise from a Hugging Face checkpoint directory (Qwen2/2.5, Qwen3, "
                        "Llama 3.x, Mistral; its config.json is checked against the model "
                        "flags; works "
                        "with and without --chunkflow, so both systems can start from the same "
                        "weights); a later --load checkpoint still takes precedence")
    g.add_argument("--chunkflow-skip-memory-check", action="store_true",
                   help="on a GPU, skip the check before step 1 that the first global batch's traced "
                        "memory fits every GPU of the job (memtrace/guard.py)")
    g.add_argument("--chunkflow-allow-untested-megatron", action="store_true",
                   help="run on a Megatron-LM checkout or megatron-core outside the supported "
                        "releases (megatron-core 0.16.1 to 0.19.2, the checkout of the same "
                        "release line), with a warning")
    return parser


def check_chunkflow_args(args, given_dataloader: str | None = None) -> None:
    """Refuse what ChunkFlow cannot run; set the two Megatron settings it needs.
    `given_dataloader`: --dataloader-type as typed (Megatron's validate_args fills in single)."""
    if not args.chunkflow:
        return
    notes = []
    mapped = _megatron_attention_backend(args)
    refuse = chunkflow_refusals(args, given_dataloader)
    if refuse:
        raise LaunchError("--chunkflow cannot run with " + "; ".join(refuse))
    try:  # the CP choices mean nothing at CP 1: refused, not ignored
        chunkflow_config(args).check_context_parallel_flags(args.context_parallel_size)
    except ValueError as e:
        raise LaunchError(str(e).replace("--attention-backend", FLAGS["attention_backend"])) \
            from None
    if not args.mock_data:  # before Megatron builds the model, not at the first batch
        try:
            check_data_path(args.data_path[0])
        except ValueError as e:
            raise LaunchError(str(e)) from None
    try:
        _check_attention_backend(args)
    except LaunchError as e:
        raise LaunchError(f"{e} (carried over from {mapped})" if mapped else str(e)) from None
    if mapped:
        notes.append(f"{FLAGS['attention_backend']} {args.chunkflow_attention_backend} (from "
                     f"{mapped}: chunk attention replaces Megatron's core attention)")
    if args.dataloader_type != "external":
        args.dataloader_type = "external"
        notes.append("--dataloader-type external (the chunk iterator)")
    if not args.calculate_per_token_loss:
        args.calculate_per_token_loss = True
        notes.append("--calculate-per-token-loss (the loss is the mean over all target tokens "
                     "of the global batch)")
    if args.sft:
        notes.append(_sft_note(args))
        if args.eval_iters and args.eval_interval:
            why = ("Megatron-LM's --sft validation averages each micro-batch's mean loss, and "
                   "under --chunkflow a micro-batch is one data chunk, which may hold no target "
                   "token")
            if _given("--eval-iters"):
                raise LaunchError(f"--chunkflow cannot run with --sft and --eval-iters "
                                  f"{args.eval_iters}: {why}; give --eval-iters 0")
            args.eval_iters = 0
            notes.append(f"--eval-iters 0 (Megatron's default is 100, but {why})")
    if notes and args.rank == 0:
        print("[chunkflow] set: " + "; ".join(notes), flush=True)


# Megatron's own attention flags, as the chunk attention backend they stand for.
MEGATRON_ATTENTION = {"flash": "flash", "fused": "te", "unfused": "torch", "local": "torch",
                      "auto": "auto"}


def _megatron_attention_backend(args) -> str | None:
    """Megatron-LM's --attention-backend / --use-flash-attn, as typed, carried over to
    --chunkflow-attention-backend, or refused naming both flags where they disagree with it or
    each other. Returns the Megatron flags carried over, None when nothing was."""
    ours = FLAGS["attention_backend"]
    given = []
    if _given("--attention-backend"):
        name = getattr(args.attention_backend, "name", str(args.attention_backend))
        given.append((f"--attention-backend {name}", MEGATRON_ATTENTION.get(name, name)))
    if getattr(args, "use_flash_attn", False):
        given.append(("--use-flash-attn", "flash"))
    if not given:
        return None
    wanted = {backend for _, backend in given if backend != "auto"}
    flags = " and ".join(flag for flag, _ in given)
    if _given(ours):
        wanted.add(args.chunkflow_attention_backend)
        flags += f" and {ours} {args.chunkflow_attention_backend}"
    if len(wanted) > 1:
        raise LaunchError(f"--chunkflow: {flags} ask for different attention kernels; with "
                          f"--chunkflow, {ours} chooses the chunk attention kernel: give one")
    if not wanted or _given(ours):
        return None
    args.chunkflow_attention_backend = wanted.pop()
    return flags


def _check_attention_backend(args) -> None:
    """The chunk attention kernel can train this run's chunks on this machine (before any model
    is built): installed, on its device and dtype, and, for a kernel that materialises the
    scores, a chunk over the longest prefix fits the device's memory."""
    from megatron_chunkflow.attention.trainable import check_trainable, device_memory_bytes

    device, dtype = _device_and_dtype(args)
    try:
        check_trainable(args.chunkflow_attention_backend, device, dtype, FLAGS["attention_backend"],
                        heads=args.num_attention_heads // args.tensor_model_parallel_size,
                        chunk=args.chunkflow_chunk_size // args.context_parallel_size,
                        keys=args.seq_length, memory_bytes=device_memory_bytes(device))
    except ValueError as e:
        raise LaunchError(str(e)) from None


def chunkflow_refusals(args, given_dataloader: str | None = None) -> list[str]:
    """Every flag --chunkflow cannot run with, one phrase each. Also called on arguments Megatron
    has not validated yet (its own layout assertion fired first), so raw flags are read where
    validation would derive a value."""
    refuse = flag_errors(args)  # the plugin's size flags outside their bounds (flags.py)
    if args.micro_batch_size != 1:
        refuse.append(f"--micro-batch-size {args.micro_batch_size}: use 1 (each data chunk of "
                      "up to --chunk-size tokens is one micro-batch)")
    if args.apply_rope_fusion:
        refuse.append("fused RoPE: add --no-rope-fusion (the fused kernel takes one position "
                      "offset per sequence; chunks need per-token positions)")
    if getattr(args, "multi_latent_attention", False):
        refuse.append("--multi-latent-attention")
    if getattr(args, "num_experts", None):
        refuse.append(f"--num-experts {args.num_experts}: Megatron's router adds its "
                      "load-balancing loss per micro-batch, which under ChunkFlow is a data chunk; "
                      "ChunkFlow's per-sequence balancing loss (`chunkflow train` and `verify` run "
                      "MoE models with it) is not wired into this launcher yet")
    dropout = [f"{flag} {p:g}" for flag, p in (("--hidden-dropout", args.hidden_dropout),
                                               ("--attention-dropout", args.attention_dropout))
               if p]
    if dropout:
        refuse.append(" ".join(dropout) + ": give 0 (Megatron-LM's default is 0.1; a re-forwarded "
                      "chunk would draw new dropout masks, so gradients would not be exact)")
    if args.position_embedding_type != "rope":
        refuse.append(f"--position-embedding-type {args.position_embedding_type}: use rope")
    if hybrid_script() and not hybrid_pattern(args):
        refuse.append("a hybrid model without --hybrid-layer-pattern: give the pattern of its "
                      "layers ('*-' per transformer layer)")
    elif hybrid_pattern(args):
        from megatron_chunkflow.mcore.hybrid import check_pattern

        try:
            check_pattern(hybrid_pattern(args))
        except ValueError as e:
            refuse.append(str(e))
    chunk_size = args.chunkflow_chunk_size
    if args.seq_length is not None and chunk_size > args.seq_length:
        default = "" if _given("--chunk-size") else " (the default)"
        refuse.append(f"--chunk-size {chunk_size}{default} above --seq-length {args.seq_length}: "
                      f"give --chunk-size {args.seq_length} or less")
    cp = args.context_parallel_size
    tp = args.tensor_model_parallel_size
    try:  # Megatron-LM turns --sequence-parallel off at TP 1
        layout = ParallelConfig(tp=tp, cp=cp, sequence_parallel=args.sequence_parallel and tp > 1)
        layout.check_chunk_size(chunk_size, naming="megatron-lm")
    except ValueError as e:
        refuse.append(str(e))
    if cp > 1 and args.seq_length is not None and args.seq_length % (2 * cp):
        refuse.append(f"--seq-length {args.seq_length}, not a multiple of 2 x "
                      f"--context-parallel-size {cp} (Megatron-LM asserts it; ChunkFlow pads "
                      f"every sequence itself, so any multiple above your longest will do)")
    for flag, dest in (("--hybrid-context-parallel", "hybrid_context_parallel"),
                       ("--hierarchical-context-parallel-sizes",
                        "hierarchical_context_parallel_sizes")):
        if getattr(args, dest, None):
            refuse.append(f"{flag}: ChunkFlow's context parallelism is one flat CP group")
    if cp > 1 and _given("--cp-comm-type"):
        refuse.append("--cp-comm-type: ChunkFlow's context parallelism all-gathers K/V itself "
                      "(Transformer Engine's CP communication is not used)")
    if cp > 1:
        from megatron_chunkflow.attention.backends import check_context_parallel
        from megatron_chunkflow.mcore.cpu import has_real_cuda

        try:
            check_context_parallel(args.chunkflow_attention_backend,
                                   "cuda" if has_real_cuda() else "cpu",
                                   "--chunkflow-attention-backend")
        except ValueError as e:
            refuse.append(str(e))
    if given_dataloader not in (None, "external"):
        refuse.append(f"--dataloader-type {given_dataloader}: ChunkFlow feeds its chunks "
                      "through --dataloader-type external")
    if not args.mock_data:
        if not args.data_path:
            refuse.append("no data: give --data-path (SFT JSONL/JSON/Parquet or a Megatron "
                          "indexed dataset prefix) or --mock-data")
        elif len(args.data_path) != 1:
            refuse.append(f"--data-path with {len(args.data_path)} entries: ChunkFlow reads one "
                          "file, directory or indexed prefix (blends are not supported)")
    return refuse


def _given(flag: str) -> bool:
    """Whether `flag` was typed on the command line (not Megatron's or the plugin's default)."""
    import sys

    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


def chunkflow_config(args) -> ChunkFlowConfig:
    """The ChunkFlowConfig of the plugin's flags in Megatron-LM's parsed `args`."""
    return config_from_args(ChunkFlowConfig, args, dest_prefix=DEST_PREFIX)


def resolve_backend(args) -> str:
    """The attention kernel --chunkflow-attention-backend stands for on this machine and in this
    run's precision."""
    from megatron_chunkflow.attention import resolve_backend as resolve

    device, dtype = _device_and_dtype(args)
    return resolve(args.chunkflow_attention_backend, device, dtype)


def _device_and_dtype(args):
    """("cuda" or "cpu", the activations' torch dtype) of this run."""
    import torch

    from megatron_chunkflow.mcore.cpu import has_real_cuda

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return "cuda" if has_real_cuda() else "cpu", dtype


def trace_settings(args):
    """This launch as the settings memtrace/ traces: megatron-core's model of the same shape and
    layout, ChunkFlow's flags, Megatron's recompute option and fusions, its precision, on a GPU
    (the plugin's build is megatron-core's local spec; with Transformer Engine's the layers keep
    other tensors)."""
    from megatron_chunkflow.config import ParallelConfig, Recompute
    from megatron_chunkflow.mcore.settings import OptimizerConfig, TrainSettings

    if args.recompute_granularity == "selective":
        recompute = Recompute("selective", tuple(args.recompute_modules or ("core_attn",)))
    elif args.recompute_granularity == "full":
        per = 2 if hybrid_pattern(args) else 1  # a hybrid model counts attention and MLP layers
        recompute = (Recompute("block", num_layers=max(1, args.recompute_num_layers // per))
                     if args.recompute_method == "block" else Recompute("full"))
    else:
        recompute = Recompute()
    parallel = ParallelConfig(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
        vpp=args.virtual_pipeline_model_parallel_size or 1, cp=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel, recompute=recompute)
    return TrainSettings(
        shape=shape_from_args(args),
        model_name="pretrain_hybrid.py" if hybrid_pattern(args) else "pretrain_gpt.py",
        chunkflow=chunkflow_config(args),
        parallel=parallel, optimizer=OptimizerConfig(lr_warmup_iters=0), train_iters=2,
        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        dtype="bfloat16" if args.bf16 else "float32", device="cuda",
        fusions=bool(args.bias_swiglu_fusion),
        model_class="hybrid" if hybrid_pattern(args) else "gpt")


HYBRID_SCRIPTS = ("pretrain_hybrid.py", "pretrain_mamba.py")  # they build HybridModel / MambaModel


def hybrid_script() -> bool:
    """Whether the script being run builds a hybrid model (the launcher runs it as sys.argv[0])."""
    import sys
    from pathlib import Path

    return Path(sys.argv[0]).name in HYBRID_SCRIPTS


def hybrid_pattern(args) -> str | None:
    """pretrain_hybrid.py's layer pattern (--hybrid-layer-pattern, or its deprecated
    --hybrid-override-pattern, which Megatron-LM's validation renames); None for pretrain_gpt.py,
    which builds no pattern."""
    if not hybrid_script():
        return None
    return getattr(args, "hybrid_layer_pattern", None) or \
        getattr(args, "hybrid_override_pattern", None)


def shape_from_args(args) -> ModelShape:
    """The model's shape for the planner's cost model and the FLOPs count: a hybrid model's
    layers are its attention + MLP pairs (mcore/hybrid.py)."""
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    pattern = hybrid_pattern(args)
    return ModelShape(
        num_layers=pattern.split("/")[0].count("*") if pattern else args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=groups, vocab_size=args.padded_vocab_size,
        tie_embeddings=not args.untie_embeddings_and_output_weights,
        qkv_bias=bool(args.add_qkv_bias or args.add_bias_linear),
        rotary_base=float(args.rotary_base), norm_eps=float(args.layernorm_epsilon),
        kv_channels=args.kv_channels, qk_norm=bool(args.qk_layernorm),
        rope_scaling_factor=float(args.rope_scaling_factor) if args.use_rope_scaling else None)


# ModelShape fields -> the Megatron-LM flags that set them (check_load_hf names them)
SHAPE_FLAGS = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size",
    "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups (with --group-query-attention)",
    "tie_embeddings": "--untie-embeddings-and-output-weights (absent: tied)",
    "qkv_bias": "--add-qkv-bias", "rotary_base": "--rotary-base", "norm_eps": "--norm-epsilon",
    "kv_channels": "--kv-channels", "qk_norm": "--qk-layernorm",
    "rope_scaling_factor": "--use-rope-scaling / --rope-scaling-factor",
}


def _sft_note(args) -> str:
    """What --sft means with --chunkflow: ChunkFlow reads --data-path itself, with the template and
    loss mask that the tokenizer Megatron was given implies (data_tokenizer)."""
    if args.tokenizer_type == "SFTTokenizer":
        how = ("conversations through SFTTokenizer's tokenize_conversation: the tokens and loss "
               "mask of Megatron's SFT dataset")
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        how = ("conversations in ChatML, or the directory's own chat template where its tokenizer "
               "has no ChatML tokens (Llama 3, Mistral), loss on assistant tokens; "
               "--tokenizer-type SFTTokenizer gives Megatron's SFT template instead")
    else:
        how = f"--tokenizer-type {args.tokenizer_type} reads pre-tokenized data only"
    return (f"--sft: ChunkFlow reads --data-path itself ({how}), one sequence per conversation, "
            "never packed, padded or truncated to --seq-length (--overlong decides)")
