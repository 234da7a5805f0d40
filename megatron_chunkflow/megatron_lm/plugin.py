"""ChunkFlow inside Megatron-LM's own training loop (pretrain_gpt.py and pretrain_hybrid.py, tags
core_v0.16.1 and core_v0.19.0; compat.py).

`install(megatron_lm_dir)` patches the seams of megatron/training before the unmodified script
runs (no Megatron file is edited); each patch delegates to Megatron's original unless
`--chunkflow` was given, so without it the script runs exactly as stock:

- arguments.add_megatron_arguments: the plugin's flags (add_chunkflow_arguments);
- arguments.validate_args: after Megatron's checks, the plugin's (check_chunkflow_args);
- training.get_model and the model builders' build_distributed_models (model.py): swap core
  attention and RoPE for chunk attention (apply_chunkflow), and --chunkflow-load-hf (also
  without --chunkflow, so both systems can start from the same weights), and
  --rope-scaling-factor honoured (weights.py);
- training.build_train_valid_test_data_iterators: ChunkFlow's step iterators, training and
  validation (--split of --data-path, or mock data), in megatron_lm/data.py;
- training.get_forward_backward_func: forward_backward_chunkflow with the plugin's forward step;
- training.num_floating_point_operations / train_step / training_log (metrics.py): FLOPs of the
  step's actual sequence lengths, and one `[chunkflow]` line after each of Megatron's log lines.
"""

from __future__ import annotations

import re
import sys
import warnings
from functools import partial
from pathlib import Path

from megatron_chunkflow import compat
from megatron_chunkflow.megatron_lm import metrics, model
from megatron_chunkflow.megatron_lm.args import (
    LaunchError,
    add_chunkflow_arguments,
    check_chunkflow_args,
    chunkflow_config,
    chunkflow_refusals,
    resolve_backend,
    shape_from_args,
)
from megatron_chunkflow.megatron_lm.hooks import HOOKS, megatron_args, print_last
from megatron_chunkflow.megatron_lm.preflight import check_launch_layout
from megatron_chunkflow.megatron_lm.weights import check_load_hf


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
    training.get_model = partial(model.get_model, training.get_model)
    for builder in compat.model_builders():
        model.patch_builder(builder)
    training.build_train_valid_test_data_iterators = partial(
        _build_iterators, training.build_train_valid_test_data_iterators)
    training.get_forward_backward_func = partial(_get_fb_func, training.get_forward_backward_func)
    training.num_floating_point_operations = partial(metrics.num_flops,
                                                     training.num_floating_point_operations)
    training.train_step = partial(metrics.train_step, training.train_step)
    training.training_log = partial(metrics.training_log, training.training_log)
    training._chunkflow_installed = True


def _build_iterators(original, provider):
    a = megatron_args()
    if not a.chunkflow:
        return original(provider)
    if getattr(provider, "keywords", {}).get("vp_stage", 0) > 0:
        # with virtual stages Megatron-LM asks once per model chunk; ChunkFlow's schedule pulls
        # one planned step for all of them from the first
        return HOOKS.iterators
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

    HOOKS.iterator = steps(train, a.consumed_train_samples)
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
    print_last(f"[chunkflow] data: {getattr(train, 'description', '')}; {len(train)} "
                f"training sequences{split}; {validation}; global batch {a.global_batch_size} "
                f"sequences, chunk size {chunkflow.chunk_size}, K {chunkflow.num_kept}, "
                f"attention {resolve_backend(a)}")
    HOOKS.iterators = (RerunDataIterator(HOOKS.iterator),
                        RerunDataIterator(valid_steps) if valid_steps is not None else None, None)
    return HOOKS.iterators


def _job():
    """The Job of Megatron-LM's process groups (mcore/job.py), read once, for its layout."""
    if HOOKS.job is None:
        from megatron_chunkflow.config import ParallelConfig
        from megatron_chunkflow.mcore.job import Job

        a = megatron_args()
        HOOKS.job = Job.from_megatron(ParallelConfig(
            tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size,
            cp=a.context_parallel_size, vpp=a.virtual_pipeline_model_parallel_size or 1,
            sequence_parallel=a.sequence_parallel))
    return HOOKS.job


def _get_fb_func(original, *args, **kwargs):
    if not megatron_args().chunkflow:
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

    if HOOKS.loss_vocab is None:
        HOOKS.loss_vocab = loss_vocab_size(megatron_args())
    job = _job()
    step_fn = make_forward_step(job.groups.tp, vocab_size=HOOKS.loss_vocab)
    kwargs["pg_collection"] = kwargs.get("pg_collection") or job.groups
    reports = forward_backward_chunkflow(forward_step_func=step_fn, **kwargs)
    if not reports and job.ranks.pp_rank == job.ranks.pp - 1:
        from megatron_chunkflow.runtime.p2p import comm_device

        # a DP rank without chunks this step: the same dtype and device as the others' reports,
        # which Megatron-LM's train_step all-reduces over DP x CP
        reports = [{"lm loss": torch.zeros(2, dtype=torch.float64, device=comm_device())}]
    return reports


