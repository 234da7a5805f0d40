"""Shims that let megatron-core (0.16.1 to 0.19.2) run on CPU with gloo (tests, CPU demos).

Applied only when CUDA is absent (`install_cpu_shims` is a no-op on a GPU machine). The package
patches torch nowhere else but megatron_lm/cpu.py, which adds what Megatron-LM's training package
needs and only the launcher installs. Each patch names the Megatron seam it serves (each verified
on CPU against megatron-core 0.16.1 and 0.19.2):

- torch.cuda.current_device: tensor_parallel/layers.py and mappings.py, distributed/
  param_and_grad_buffer.py, utils.py GlobalMemoryBuffer, rotary_pos_embedding.py allocate there.
- torch.cuda.synchronize: p2p_communication.py after batched exchanges and shape handshakes.
- torch.cuda RNG (get/set_rng_state, manual_seed) and tensor_parallel/random.py
  _get_cuda_rng_state/_set_cuda_rng_state: model_parallel_cuda_manual_seed, the RNG tracker's fork()
  and CheckpointFunction (full recompute) use the CUDA generator; on CPU they share the CPU one.
  manual_seed_all becomes a no-op (torch.manual_seed calls it: mapping it back would recurse).
- device="cuda" in factory functions, Tensor.cuda() and Tensor.to("cuda"), by wrapping those
  functions: pipeline_parallel/schedules.py (total_num_tokens), optimizer/optimizer.py (found_inf,
  scale), language_module.py (tied embeddings under PP > 1: weight.data.cuda()),
  transformer/utils.py masks, param_and_grad_buffer.py (0.19: a warm-up tensor on "cuda").
- torch.cuda streams and events (0.19's param_and_grad_buffer.py start_grad_sync calls
  torch.cuda.current_stream() unconditionally; DDP's communication stream): already complete.
- MoE (build.py, for a model with experts): the router's te_general_gemm (0.16.1), the
  all-to-all dispatcher's split sizes (fix_dispatcher_splits_on_cpu).
- optimizer/clip_grads.py clip_grad_by_total_norm_fp32 asserts grads are torch.cuda.FloatTensor; the
  CPU version below is the same scaling without that assert (looked up by optimizer/optimizer.py).
"""

from __future__ import annotations

import contextlib

import torch

_INSTALLED = False


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


# torch's functions that take device=: a CUDA device becomes the CPU (wrapped once, in place)
FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "range",
             "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "normal",
             "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
             "randint_like", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices")
TENSOR_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
                  "new_empty_strided")
_ORIGINALS: dict[tuple[object, str], object] = {}


def _on_cpu(fn):
    """`fn` with a CUDA `device=` argument made the CPU."""
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__wrapped__, wrapper.__name__, wrapper.__doc__ = fn, fn.__name__, fn.__doc__
    return wrapper


def _tensor_to(self, *args, **kwargs):
    """Tensor.to with a CUDA device (positional or device=) made the CPU."""
    if args and not isinstance(args[0], (torch.dtype, torch.Tensor)) and _is_cuda(args[0]):
        args = ("cpu", *args[1:])
    device = kwargs.get("device")
    if device is not None and _is_cuda(device):
        kwargs["device"] = "cpu"
    return _ORIGINALS[torch.Tensor, "to"](self, *args, **kwargs)


def _tensor_cuda(self, *args, **kwargs):
    """Tensor.cuda on CPU: the tensor itself (Module.cuda moves nothing either)."""
    return self


def _wrap_torch() -> None:
    """device="cuda" (or an int, or torch.device("cuda")) in factory functions, Tensor.cuda() and
    Tensor.to("cuda") answered on the CPU: by wrapping those functions, not with a mode that
    every torch call would pass through (a TorchFunctionMode costs Python on each op: 45% of a
    small float64 step's time, measured). Megatron calls these as `torch.zeros(...)`, attributes
    looked up at call time."""
    from torch.utils import _device

    # torch.device(...) as a context (transformers' loading on the meta device) tells factories by
    # identity from a cached set: cache the originals before they are wrapped
    _device._device_constructors()
    targets = [(torch, name, _on_cpu) for name in FACTORIES] + \
        [(torch.Tensor, name, _on_cpu) for name in TENSOR_METHODS] + \
        [(torch.Tensor, "to", lambda fn: _tensor_to), (torch.Tensor, "cuda", lambda fn: _tensor_cuda)]
    for owner, name, wrap in targets:
        if (owner, name) not in _ORIGINALS and hasattr(owner, name):
            _ORIGINALS[owner, name] = getattr(owner, name)
            setattr(owner, name, wrap(_ORIGINALS[owner, name]))


@contextlib.contextmanager
def native_torch():
    """torch's own factory functions and Tensor.to/.cuda for the enclosed code (the memory
    tracer's function mode decides where "cuda" goes, and compares functions by identity); the
    CPU wrappers come back on exit."""
    wrapped = {key: getattr(*key) for key in _ORIGINALS}
    for (owner, name), fn in _ORIGINALS.items():
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for (owner, name), fn in wrapped.items():
            setattr(owner, name, fn)


class _Stream:
    """torch.cuda.Stream / Event stand-in: every operation is already complete on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _Stream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clip_grad_by_total_norm_fp32 without its CUDA-type assert."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def fix_checkpoint_without_output() -> None:
    """megatron-core 0.16.1's tensor_parallel.CheckpointWithoutOutput (selective recompute of the
    layernorms) sets `self.fp8 = fp8 is not None`, so its default fp8=False reads as FP8 and its
    forward calls Transformer Engine's FP8GlobalStateManager, which is undefined without TE (a
    NameError). Without TE there is no FP8: the flag is made False. A no-op when TE is installed
    (then the check works as intended)."""
    import importlib.util

    from megatron.core.tensor_parallel import random as mcore_random

    if importlib.util.find_spec("transformer_engine") is not None or \
            getattr(mcore_random.CheckpointWithoutOutput, "_chunkflow_fixed", False):
        return
    original = mcore_random.CheckpointWithoutOutput.__init__

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = False

    mcore_random.CheckpointWithoutOutput.__init__ = __init__
    mcore_random.CheckpointWithoutOutput._chunkflow_fixed = True


def fix_router_gemm_without_te() -> None:
    """megatron-core 0.16.1's MoE router (moe_utils.py router_gating_linear) tests
    `te_general_gemm is not None`, a name it defines only when Transformer Engine imports: without
    TE every router forward is a NameError (0.17 binds it to None). Bound to None here, as 0.17
    does; a no-op where the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def fix_dispatcher_splits_on_cpu() -> None:
    """The all-to-all dispatcher under expert parallelism (token_dispatcher.py
    _maybe_dtoh_and_synchronize) moves its split sizes to the host as numpy arrays with
    moe_utils.maybe_move_tensor_to_cpu, which converts only CUDA tensors: on CPU the splits stay
    tensors, which torch.distributed.all_to_all_single refuses as split sizes. Here a host tensor
    asked for as numpy becomes numpy too, as a device one would."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu
    if not _INSTALLED or getattr(original, "_chunkflow_fixed", False):  # a GPU: as Megatron has it
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._chunkflow_fixed = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def install_cpu_shims() -> bool:
    """Patch torch (and megatron-core's CUDA RNG helpers) for CPU; returns True if installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda *a, **k: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.Stream = cuda.Event = _Stream
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: _Stream()

    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm

    fix_checkpoint_without_output()
    _wrap_torch()
    _INSTALLED = True
    return True


# install_megatron_lm_cpu_shims (megatron_lm/cpu.py) makes torch.cuda claim a device on CPU;
# this is what the machine really has.
_REAL_CUDA = torch.cuda.is_available()


def has_real_cuda() -> bool:
    """Whether a CUDA device exists (megatron_lm/cpu.py's shims make torch.cuda say so on CPU)."""
    return _REAL_CUDA
