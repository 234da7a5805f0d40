"""ChunkFlow inside Megatron-LM's own training loop (pretrain_gpt.py, tag core_v0.16.1).

`install(megatron_lm_dir)` patches five seams of megatron/training before the unmodified script
runs (no Megatron file is edited); each patch delegates to Megatron's original unless
`--chunkflow` was given, so without it the script runs exactly as stock:

- arguments.add_megatron_arguments: the plugin's flags (add_chunkflow_arguments);
- initialize.validate_args: after Megatron's checks, the plugin's (check_chunkflow_args);
- training.get_model: swap core attention and RoPE for chunk attention (apply_chunkflow), and
  --chunkflow-load-hf (also without --chunkflow, so both systems can start from the same weights),
  and --rope-scaling-factor honoured (weights.py);
- training.build_train_valid_test_data_iterators: ChunkFlow's step iterators, training and
  validation (--split of --data-path, or mock data), in megatron_lm/data.py;
- training.get_forward_backward_func: forward_backward_chunkflow with the plugin's forward step;
- training.num_floating_point_operations / train_step / training_log: FLOPs of the step's actual
  sequence lengths, and one `[chunkflow]` line (tokens, tokens/s/GPU, model TFLOP/s/GPU, chunks,
  re-forwarded fraction, peak memory) after each of Megatron's log lines.
"""

from __future__ import annotations

import re
import sys
import time
import warnings
from functools import partial
from pathlib import Path

from megatron_chunkflow import compat
from megatron_chunkflow.megatron_lm.args import (
    LaunchError,
    add_chunkflow_arguments,
    check_chunkflow_args,
    chunkflow_config,
    chunkflow_refusals,
    resolve_backend,
    shape_from_args,
)
from megatron_chunkflow.megatron_lm.preflight import check_launch_layout
from megatron_chunkflow.megatron_lm.weights import check_load_hf, load_hf, rope_factor_provider


def checkout_version(megatron_lm_dir: Path) -> str:
    """The version in a Megatron-LM checkout's megatron/core/package_info.py."""
    info = megatron_lm_dir / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise LaunchError(f"{megatron_lm_dir} is not a Megatron-LM checkout: {info} is missing "
                          "(give the path of its pretrain_gpt.py)")
    parts = {m.group(1): m.group(2) for m in
             re.finditer(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([^'\"\n]*)['\"]?",
                         info.read_text(), re.M)}
    return ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH")) + \
        parts.get("PRE_RELEASE", "")


def check_versions(megatron_lm_dir: Path, allow_untested: bool) -> None:
    """The installed megatron-core in compat.RANGE, and the Megatron-LM checkout of the same
    release line (its megatron/training is written against its own megatron/core): else a
    LaunchError naming both, or with --chunkflow-allow-untested-megatron a warning."""
    import megatron.core

    checkout = checkout_version(megatron_lm_dir)
    problem = compat.megatron_lm_problem(compat.parse_version(checkout))
    if problem is None:
        return
    message = (f"Megatron-LM at {megatron_lm_dir} is {checkout} and megatron-core at "
               f"{Path(megatron.core.__file__).parent} is {compat.version_text()}: {problem}")
    if not allow_untested:
        raise LaunchError(message + " (or pass --chunkflow-allow-untested-megatron to try anyway)")
    warnings.warn(message + " (--chunkflow-allow-untested-megatron: continuing)", stacklevel=2)


class _Hooks:
    """State the patched functions share: the step iterator and the log interval's totals."""

    def __init__(self):
        self.iterator = None
        self.in_log = False
        self.interval_flops = self.interval_tokens = self.interval_time = 0.0
        self.interval_steps = 0
        self.loss_vocab = None  # megatron_lm/data.py loss_vocab_size, read once
        self.store = None  # the K/V state store every model chunk of this rank shares
        self.iterators = None  # built once; every virtual stage's slot gets the same
        self.memory_checked = False  # memtrace/guard.py before the first step
        self.job = None  # mcore/job.py: Megatron-LM's process groups, read once


_HOOKS = _Hooks()


def prebuilt_dataset_helpers() -> bool:
    """Megatron-LM's initialize `make`s its C++ dataset helpers; the megatron-core wheel ships them
    built and no Makefile, so on a bare GPU machine the build is skipped (True) where the built
    module imports (a source checkout builds as usual; on CPU megatron_lm/cpu.py skips it)."""
    import importlib.util

    from megatron.core.datasets import utils as dataset_utils

    here = Path(dataset_utils.__file__).parent
    if (here / "Makefile").is_file() or importlib.util.find_spec(
            "megatron.core.datasets.helpers_cpp") is None:
        return False
    dataset_utils.compile_helpers = lambda: None
    return True


def install(megatron_lm_dir: str | Path, allow_untested: bool | None = None) -> None:
    """Patch megatron/training so that pretrain_gpt.py honours --chunkflow; idempotent.
    `allow_untested` None: whether --chunkflow-allow-untested-megatron is on the command line."""
    from megatron_chunkflow.megatron_lm import cpu

    if allow_untested is None:
        allow_untested = "--chunkflow-allow-untested-megatron" in sys.argv
    megatron_lm_dir = Path(megatron_lm_dir).resolve()
    cpu.install_megatron_lm_cpu_shims()
    compat.backport_typing_override()
    import megatron.core  # noqa: F401  the installed megatron-core, before the checkout's copy

    prebuilt_dataset_helpers()

    check_versions(megatron_lm_dir, allow_untested)
    if str(megatron_lm_dir) not in sys.path:
        sys.path.append(str(megatron_lm_dir))  # megatron.training, gpt_builders, model_provider
    from megatron.training import arguments, initialize, training

    cpu.install_megatron_lm_training_shims()
    if getattr(training, "_chunkflow_installed", False):
        return
    original_add = arguments.add_megatron_arguments
    arguments.add_megatron_arguments = lambda parser: add_chunkflow_arguments(original_add(parser))
    original_validate = arguments.validate_args

    def validate_args(args, defaults=None):
        given_dataloader = args.dataloader_type  # Megatron's validate_args defaults it to single
        refuse = chunkflow_refusals(args, given_dataloader) if args.chunkflow else []
        if refuse:  # what the user must change first, named as the plugin names it
            raise LaunchError("--chunkflow cannot run with " + "; ".join(refuse))
        check_launch_layout(args)  # before Megatron's assertions, named by flag
        try:
            out = original_validate(args, defaults if defaults is not None else {})
        except AssertionError as e:  # what Megatron-LM asserts, one line, not a traceback
            why = str(e) or "an assertion in its validate_args"
            raise LaunchError(f"Megatron-LM refused the arguments: {why}") from None
        check_chunkflow_args(args, given_dataloader)
        check_load_hf(args)
        args.chunkflow_checked = True
        return out

    # core_v0.16.1 calls it as initialize.validate_args; later tags from arguments itself
    arguments.validate_args = validate_args
    if hasattr(initialize, "validate_args"):
        initialize.validate_args = validate_args
    training.get_model = partial(_get_model, training.get_model)
    for builder in compat.model_builders():
        _patch_builder(builder)
    training.build_train_valid_test_data_iterators = partial(
        _build_iterators, training.build_train_valid_test_data_iterators)
    training.get_forward_backward_func = partial(_get_fb_func, training.get_forward_backward_func)
    training.num_floating_point_operations = partial(_num_flops,
                                                     training.num_floating_point_operations)
    training.train_step = partial(_train_step, training.train_step)
    training.training_log = partial(_training_log, training.training_log)
    training._chunkflow_installed = True


def _args():
    from megatron.training import get_args

    return get_args()


def _get_model(original, model_provider_func, *args, **kwargs):
    """training.get_model: the model built from a model provider (pretrain_gpt.py's at
    core_v0.16.1; later tags build through a model builder, _build_distributed_models)."""
    return _built_models(lambda wrap: original(wrap(model_provider_func), *args, **kwargs))


def _patch_builder(cls) -> None:
    original = cls.build_distributed_models

    def build_distributed_models(self, *args, **kwargs):
        return _build_distributed_models(original, self, *args, **kwargs)

    cls.build_distributed_models = build_distributed_models


def _build_distributed_models(original, builder, *args, **kwargs):
    """A model builder's build_distributed_models (megatron/training/models, core_v0.18 on: the
    config container's path): the same as _get_model, its build_model being the provider."""
    def build(wrap):
        builder.build_model = wrap(builder.build_model)  # shadows the method for this build
        try:
            return original(builder, *args, **kwargs)
        finally:
            del builder.build_model

    return _built_models(build)


def _built_models(build):
    """`build(wrap)` builds the model list with `wrap(provider)` as its per-stage provider: the
    provider gets --rope-scaling-factor and, with --chunkflow, chunk attention swapped in before
    Megatron wraps the model (DDP registers hooks per module); --chunkflow-load-hf after."""
    from megatron_chunkflow.runtime.model import building_core_attention_without_cp

    a = _args()
    if (a.chunkflow or a.chunkflow_load_hf) and not getattr(a, "chunkflow_checked", False):
        raise LaunchError("this Megatron-LM did not run the plugin's argument checks (they are "
                          "installed on its validate_args); megatron_chunkflow supports "
                          f"{compat.MEGATRON_LM_TAGS}")

    def wrap(provider):
        # both systems: the RoPE frequencies --rope-scaling-factor asks for (weights.py)
        provider = partial(rope_factor_provider, provider, a)
        if a.chunkflow:
            provider = partial(_chunkflow_provider, provider, resolve_backend(a),
                               chunkflow_config(a).loss_piece)
        return provider

    _HOOKS.store = None  # a new model: its model chunks get one new store
    with building_core_attention_without_cp(a.context_parallel_size if a.chunkflow else 1):
        model = build(wrap)
    if a.chunkflow_load_hf:
        load_hf(model, a.chunkflow_load_hf)
    import torch.distributed as dist

    from megatron_chunkflow.attention.lse import ring_fallback

    note = ring_fallback(chunkflow_config(a), a.context_parallel_size, resolve_backend(a)) \
        if a.chunkflow else None
    if note and dist.get_rank() == 0:  # a substitution said, as train says it
        print(f"chunkflow: {note}", flush=True)
    return model


def _chunkflow_provider(provider, backend: str, loss_piece: int, *args, **kwargs):
    """pretrain_gpt.py's model provider, then chunk attention swapped in: before get_model wraps
    the model in Float16Module and DDP, whose forward pre-hooks (--overlap-param-gather) and
    gradient hooks are registered per module and parameter of the finished model. With virtual
    stages get_model calls it once per model chunk; the chunks share one K/V state store.
    `loss_piece` (--chunkflow-loss-piece): the last stage's loss in token pieces; Megatron-LM's
    padded vocabulary rows stay in its softmax, as its own cross entropy keeps them."""
    from megatron_chunkflow.runtime.model import apply_chunkflow

    model = provider(*args, **kwargs)
    _HOOKS.store = apply_chunkflow(model, backend=backend, store=_HOOKS.store,
                                   loss_piece=loss_piece)
    return model


def _build_iterators(original, provider):
    a = _args()
    if not a.chunkflow:
        return original(provider)
    if getattr(provider, "keywords", {}).get("vp_stage", 0) > 0:
        # with virtual stages Megatron-LM asks once per model chunk; ChunkFlow's schedule pulls
        # one planned step for all of them from the first
        return _HOOKS.iterators
    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_chunkflow.megatron_lm.data import ChunkFlowStepIterator, open_datasets

    train, valid, split = open_datasets(a)
    chunkflow = chunkflow_config(a)
    job = _job()

    def steps(dataset, consumed):
        return ChunkFlowStepIterator(
            dataset=dataset, global_batch_size=a.global_batch_size, seed=a.seed,
            chunkflow=chunkflow, parallel=job.parallel, ranks=job.ranks,
            shape=shape_from_args(a), consumed=consumed)

    _HOOKS.iterator = steps(train, a.consumed_train_samples)
    evaluating = bool(a.eval_iters and a.eval_interval and valid is not None and len(valid))
    valid_steps = steps(valid, a.consumed_valid_samples) if evaluating else None
    a.do_train, a.do_valid, a.do_test = a.train_iters > 0, evaluating, False
    if evaluating:
        validation = (f"validation: {len(valid)} sequences{split}, {a.eval_iters} global "
                      f"batches every {a.eval_interval} iterations, chunked as in training")
    elif a.eval_iters and a.eval_interval:
        validation = f"no validation: the validation split is empty{split}"
    else:
        validation = "no validation (--eval-iters 0)"
    _print_last(f"[chunkflow] data: {getattr(train, 'description', '')}; {len(train)} "
                f"training sequences{split}; {validation}; global batch {a.global_batch_size} "
                f"sequences, chunk size {chunkflow.chunk_size}, K {chunkflow.num_kept}, "
                f"attention {resolve_backend(a)}")
    _HOOKS.iterators = (RerunDataIterator(_HOOKS.iterator),
                        RerunDataIterator(valid_steps) if valid_steps is not None else None, None)
    return _HOOKS.iterators


def _job():
    """The Job of Megatron-LM's process groups (mcore/job.py), read once, for its layout."""
    if _HOOKS.job is None:
        from megatron_chunkflow.config import ParallelConfig
        from megatron_chunkflow.mcore.job import Job

        a = _args()
        _HOOKS.job = Job.from_megatron(ParallelConfig(
            tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
            cp=a.context_parallel_size, vpp=a.virtual_pipeline_model_parallel_size or 1,
            sequence_parallel=a.sequence_parallel))
    return _HOOKS.job


def _get_fb_func(original, *args, **kwargs):
    if not _args().chunkflow:
        return original(*args, **kwargs)
    return _chunkflow_forward_backward


def _chunkflow_forward_backward(*, forward_step_func, **kwargs):
    """Megatron-LM's forward_step (pretrain_gpt.py) reads fixed-shape batches through a TP
    broadcast; chunks carry their own shapes, so the plugin's forward step runs instead (the same
    model call and Megatron's own vocab-parallel cross entropy, summed per token)."""
    import torch

    from megatron_chunkflow.megatron_lm.data import loss_vocab_size
    from megatron_chunkflow.runtime.loss import make_forward_step
    from megatron_chunkflow.runtime.schedules import forward_backward_chunkflow

    if _HOOKS.loss_vocab is None:
        _HOOKS.loss_vocab = loss_vocab_size(_args())
    job = _job()
    step_fn = make_forward_step(job.groups.tp, vocab_size=_HOOKS.loss_vocab)
    kwargs["pg_collection"] = kwargs.get("pg_collection") or job.groups
    reports = forward_backward_chunkflow(forward_step_func=step_fn, **kwargs)
    if not reports and job.ranks.pp_rank == job.ranks.pp - 1:
        from megatron_chunkflow.runtime.p2p import comm_device

        # a DP rank without chunks this step: the same dtype and device as the others' reports,
        # which Megatron-LM's train_step all-reduces over DP x CP
        reports = [{"lm loss": torch.zeros(2, dtype=torch.float64, device=comm_device())}]
    return reports


def _num_flops(original, args, batch_size, *rest, **kwargs):
    # core_v0.19.0 also passes the batch's packed-sequence statistics, which ChunkFlow's own count
    # (the step's actual sequence lengths) already covers
    if not args.chunkflow or _HOOKS.iterator is None:
        return original(args, batch_size, *rest, **kwargs)
    if _HOOKS.in_log and _HOOKS.interval_steps:
        return _HOOKS.interval_flops / _HOOKS.interval_steps  # mean over the log interval
    return _HOOKS.iterator.last.flops


def _train_step(original, *args, **kwargs):
    a = _args()
    if not a.chunkflow:
        return original(*args, **kwargs)
    if not _HOOKS.memory_checked:
        _HOOKS.memory_checked = True
        from megatron_chunkflow.mcore.cpu import has_real_cuda

        if not a.chunkflow_skip_memory_check and has_real_cuda():
            from megatron_chunkflow.megatron_lm.args import trace_settings
            from megatron_chunkflow.memtrace.guard import check_memory

            check_memory(trace_settings(a), _HOOKS.iterator.next_lengths())
    start = time.perf_counter()
    out = original(*args, **kwargs)
    last = _HOOKS.iterator.last
    _HOOKS.interval_time += time.perf_counter() - start
    _HOOKS.interval_flops += last.flops
    _HOOKS.interval_tokens += last.tokens
    _HOOKS.interval_steps += 1
    return out


def _training_log(original, *args, **kwargs):
    a = _args()
    if not a.chunkflow or _HOOKS.iterator is None:
        return original(*args, **kwargs)
    _HOOKS.in_log = True
    try:
        out = original(*args, **kwargs)
    finally:
        _HOOKS.in_log = False
    iteration = args[3] if len(args) > 3 else kwargs["iteration"]
    first = kwargs.get("is_first_iteration", False)
    if (iteration % a.log_interval == 0 or first) and _HOOKS.interval_steps:
        metrics = _interval_metrics(a)
        _print_last(_log_line(iteration, metrics))
        from megatron.training import get_tensorboard_writer, get_wandb_writer

        write_metrics(get_tensorboard_writer(), get_wandb_writer(), metrics, iteration)
        if not first:
            _HOOKS.interval_flops = _HOOKS.interval_tokens = _HOOKS.interval_time = 0.0
            _HOOKS.interval_steps = 0
    return out


def _interval_metrics(a) -> dict[str, float]:
    """The log interval's ChunkFlow metrics, keyed as TensorBoard and W&B get them."""
    from megatron_chunkflow.mcore.step import peak_memory_bytes

    h, last = _HOOKS, _HOOKS.iterator.last
    per_step = h.interval_time / h.interval_steps
    tokens = h.interval_tokens / h.interval_steps
    return {"chunkflow/tokens": tokens,
            "chunkflow/tokens_per_sec_per_gpu": tokens / per_step / a.world_size,
            "chunkflow/model_tflops_per_gpu":
                h.interval_flops / h.interval_steps / per_step / a.world_size / 1e12,
            "chunkflow/chunks": float(last.chunks),
            "chunkflow/reforwarded_fraction": float(last.reforwarded),
            "chunkflow/peak_memory_gib": peak_memory_bytes() / 2**30}


def _log_line(iteration: int, m: dict[str, float]) -> str:
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    memory = "peak allocated GiB" if has_real_cuda() else "peak RSS GiB"
    return (f"[chunkflow] iteration {iteration} | tokens {int(m['chunkflow/tokens'])} | "
            f"tokens/s/GPU {m['chunkflow/tokens_per_sec_per_gpu']:.1f} | model TFLOP/s/GPU "
            f"{m['chunkflow/model_tflops_per_gpu']:.3f} | chunks {int(m['chunkflow/chunks'])} | "
            f"recompute {m['chunkflow/reforwarded_fraction']:.2f} | {memory} "
            f"{m['chunkflow/peak_memory_gib']:.2f}")


def write_metrics(tensorboard, wandb, metrics: dict[str, float], iteration: int) -> None:
    """The [chunkflow] line's metrics to Megatron-LM's TensorBoard and W&B writers (each exists
    on the last rank when --tensorboard-dir / --wandb-project was given; None elsewhere)."""
    if tensorboard is not None:
        for key, value in metrics.items():
            tensorboard.add_scalar(key, value, iteration)
    if wandb is not None:
        wandb.log(metrics, iteration)


def _print_last(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(line, flush=True)
