"""The traced GPU: a run's CUDA device played by PyTorch's meta device, on a machine without one.

    ledger = Ledger()
    with traced_device(ledger, stack):
        ...   # the real build and step: every device tensor is a meta tensor, counted by `ledger`

Inside the context every tensor the code puts on the GPU lives on the meta device: it has a shape,
a dtype and a storage of a size, but no data, so a 72B model at 256K costs no memory here. What the
code reads back from the device reads zeros (`Tensor.item()` and every other scalar read), which
decides nothing a memory trace depends on: shapes come from the plan, not from values. Three kinds
of tensor meet:

- device tensors (meta, counted as GPU memory): what the code allocates on `cuda`, or moves there;
  they say `device == cuda` and `is_cuda`, so the code takes its GPU paths (Megatron's type checks,
  torch's foreach optimizer, the attention backends' device checks);
- host tensors of floating dtype (meta too, counted as host memory): what the code allocates on the
  CPU before moving it (the local spec's norm weights) or keeps there (pinned offload buffers);
  `.cuda()` / `.to("cuda")` of one makes a device copy, as it would;
- host index tensors (real CPU tensors of integer or bool dtype): token ids, positions, segment
  offsets; host index math runs for real, so `cu_seqlens.tolist()` and friends give real values.

A real tensor that meets a meta one becomes meta for that op. Collectives take a meta tensor to the
fake process group (memtrace/job.py) as an empty placeholder: nothing moves, shapes are the
caller's. Kernels whose CUDA implementation keeps other tensors for backward than the meta (CPU)
one are run as on CUDA, by the stack's rules (memtrace/stack.py): torch's fused RMSNorm kernel
saves its input, weight and a per-row fp32 rstd, where the composite CPU path saves three full
fp32 copies. torch.compile runs eagerly here (Megatron's jit-fused SwiGLU, bias-dropout-add), but
what a compiled function allocates and frees inside is dropped (memtrace/ledger.py fused), as
its one fused kernel holds it in registers.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from megatron_chunkflow.memtrace.ledger import Ledger
from megatron_chunkflow.memtrace.metacache import MetaOutputs, tensors_in
from megatron_chunkflow.memtrace.stack import Stack

META = torch.device("meta")
CUDA = torch.device("cuda", 0)
HOST = torch.device("cpu")
_DEVICE = torch._C.TensorBase.__dict__["device"]
_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]
aten = torch.ops.aten


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _is_host(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


class _FusedRMSNorm(torch.autograd.Function):
    """torch's CUDA RMSNorm (_fused_rms_norm) as memory: saves x, weight and rstd [rows, 1] fp32;
    its backward returns one gradient per input. Values are not computed (meta)."""

    @staticmethod
    def forward(ctx, x, weight, ledger):
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        ctx.ledger = ledger
        y = torch.empty_like(x)
        _census_kernel(ledger, "_fused_rms_norm", (x, weight), (y, rstd))
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.empty_like(x), None if weight is None else torch.empty_like(weight)
        _census_kernel(ctx.ledger, "_fused_rms_norm_backward", (grad, x, weight, rstd), (dx, dw))
        return dx, dw, None


def _census_kernel(ledger: Ledger, name: str, reads, writes) -> None:
    """One fused kernel into the ledger's census (memtrace/census.py), where one is kept."""
    if ledger.census is not None:
        tensors = [t for t in (*reads, *writes) if isinstance(t, torch.Tensor)]
        on = [t for t in tensors if t.is_meta and not ledger.is_host(t)]
        ledger.census.kernel(name, ledger.labeler(name).phase,
                             [t for t in reads if any(t is o for o in on)],
                             [t for t in writes if any(t is o for o in on)])


class _Functions(TorchFunctionMode):
    """torch-level rules: `cuda` means the meta device, meta tensors say they are on cuda (or on
    the host), moves between host and device copy, CUDA kernels' memory where it differs."""

    def __init__(self, ledger: Ledger, stack: Stack, cpu: bool = False):
        super().__init__()
        self.ledger, self.stack, self.cpu = ledger, stack, cpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE and args[0].is_meta:
            return HOST if self.cpu or self.ledger.is_host(args[0]) else CUDA
        if owner is _IS_CUDA and args[0].is_meta:
            return not (self.cpu or self.ledger.is_host(args[0]))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].is_meta:
            return func(*args).replace("torch.meta.", "torch." if self.cpu else "torch.cuda.")
        if self.cpu and func is torch.Tensor.cpu and args[0].is_meta:
            return args[0]  # the traced device is the host
        if func is torch.Tensor.cuda or func is torch.Tensor.to or func is torch.Tensor.cpu:
            return self._move(func, args, kwargs)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": META}
        if func is torch.tensor and self._holds_meta(args[:1]):
            return self._tensor_of_meta(args[0], kwargs)
        if (self.stack.fused_rms_norm and not self.cpu and func in (torch.rms_norm, torch.nn.functional.rms_norm)
                and args[0].is_meta):
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            return _FusedRMSNorm.apply(args[0], weight, self.ledger)
        return func(*args, **kwargs)

    def _move(self, func, args, kwargs):
        """Tensor.cuda / .to / .cpu: a host tensor moved to the device is copied there, a device
        tensor moved to the host is copied there; the rest as torch does it."""
        t, rest = args[0], list(args[1:])
        if func is torch.Tensor.cuda:
            target = CUDA
        elif func is torch.Tensor.cpu:
            target = torch.device("cpu")
        else:
            target = kwargs.get("device")
            for i, a in enumerate(rest):
                if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):
                    target = a
                    rest[i] = META if _is_cuda(a) else a
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = {**kwargs, "device": META}
        if not isinstance(t, torch.Tensor):
            return func(t, *rest, **kwargs)
        to_device, to_host = target is not None and _is_cuda(target), _is_host(target)
        if t.is_meta and not self.cpu and (to_device and self.ledger.is_host(t)
                                           or to_host and not self.ledger.is_host(t)):
            dtype = next((a for a in rest if isinstance(a, torch.dtype)), kwargs.get("dtype"))
            with self.ledger.placing(host=to_host):
                return torch.empty_like(t, dtype=dtype or t.dtype, device=META)
        if func is torch.Tensor.cuda:
            return torch.Tensor.to(t, META, **{k: v for k, v in kwargs.items()
                                               if k == "non_blocking"})
        if to_host and t.is_meta:  # already on the host
            return t if not kwargs.get("dtype") else torch.Tensor.to(t, kwargs["dtype"])
        return func(t, *rest, **kwargs)

    @staticmethod
    def _holds_meta(data) -> bool:
        return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(data))

    def _tensor_of_meta(self, data, kwargs):
        """torch.tensor([...meta scalars...]): a meta tensor of that shape (no values to read)."""
        shape, level = [], data
        while isinstance(level, (list, tuple)):
            shape.append(len(level))
            level = level[0] if level else None
        first = next(t for t in tree_leaves(data) if isinstance(t, torch.Tensor))
        return torch.empty(shape, dtype=kwargs.get("dtype") or first.dtype, device=META)


_FACTORY_SKIP = (aten.lift_fresh.default, aten.lift_fresh_copy.default)


def _inferred_dtype(func, args) -> torch.dtype:
    """A factory's dtype when none is given: arange and full take their scalars' (integers give
    int64: index math, kept on the host), the others the default floating dtype."""
    if func._schema.name in ("aten::arange", "aten::full", "aten::scalar_tensor"):
        scalars = [a for a in args if isinstance(a, (int, float, bool))]
        if scalars and all(isinstance(a, bool) for a in scalars):
            return torch.bool
        if scalars and all(isinstance(a, int) for a in scalars):
            return torch.int64
    return torch.get_default_dtype()


class _Dispatch(TorchDispatchMode):
    """aten-level rules: factories placed, real tensors meeting meta ones made meta, scalar reads
    answered, collectives on meta tensors sent as placeholders, every new storage counted.

    Ops with fresh outputs are answered from memtrace/metacache.py's cache after one run."""

    def __init__(self, ledger: Ledger, cpu: bool = False):
        super().__init__()
        self.ledger, self.cpu = ledger, cpu
        self._outputs = MetaOutputs()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and args[0].is_meta:
            self.ledger.scalar_reads += 1
            dtype = args[0].dtype
            return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
        if func.namespace == "c10d":
            out = self._collective(func, args, kwargs)
            self._count(func, args, kwargs, out)
            return out
        if _is_cuda(kwargs.get("device")):  # torch-level code the function mode did not see: a
            kwargs = {**kwargs, "device": META}  # backward run inside a torch function's handler
        leaves = tensors_in((args, kwargs.values()))
        host = False  # where a new meta storage lives: the device unless said otherwise
        if not leaves and "device" in kwargs and func not in _FACTORY_SKIP:
            device = kwargs["device"]
            dtype = kwargs.get("dtype") or _inferred_dtype(func, args)
            if (device is None or torch.device(device).type == "cpu") and (
                    dtype.is_floating_point or dtype.is_complex):
                kwargs, host = {**kwargs, "device": META}, not self.cpu
        metas = [t for t in leaves if t.is_meta]
        if metas:
            if any(not t.is_meta for t in leaves):
                self._refuse_real_write(func, args)
                args, kwargs = tree_map(
                    lambda t: t.to(META) if isinstance(t, torch.Tensor) and not t.is_meta else t,
                    (args, kwargs))
            host = all(self.ledger.is_host(t) for t in metas)
        out = self._outputs.run(func, args, kwargs) if metas and len(metas) == len(leaves) else \
            func(*args, **kwargs)
        with self.ledger.placing(host=host):
            for t in tensors_in(out):
                if t.is_meta:
                    self.ledger.allocated(t.untyped_storage(), func)
        self._count(func, args, kwargs, out)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        """The op into the ledger's census of kernels (memtrace/census.py), where one is kept."""
        census = self.ledger.census
        if census is not None:
            ledger = self.ledger
            census.op(func, args, kwargs, out, ledger.labeler(func).phase,
                      lambda t: t.is_meta and not ledger.is_host(t))

    @staticmethod
    def _refuse_real_write(func, args) -> None:
        schema = func._schema
        if schema.is_mutable and args and isinstance(args[0], torch.Tensor) and \
                not args[0].is_meta and any(a.alias_info and a.alias_info.is_write
                                            for a in schema.arguments[:1]):
            raise RuntimeError(f"memory trace: {func} writes device data into a host tensor of "
                               f"shape {tuple(args[0].shape)}; the traced step must not read "
                               "values back from the GPU")

    @staticmethod
    def _collective(func, args, kwargs):
        """A c10d op on meta tensors: the fake process group is handed empty host placeholders
        and the caller gets its own tensors back (nothing is sent, nothing arrives)."""
        placeholders: dict[int, torch.Tensor] = {}

        def placeholder(t):
            if isinstance(t, torch.Tensor) and t.is_meta:
                p = torch.empty(0, dtype=t.dtype)
                placeholders[id(p)] = t
                return p
            return t

        out = func(*tree_map(placeholder, args), **tree_map(placeholder, kwargs))
        return tree_map(lambda t: placeholders.get(id(t), t) if isinstance(t, torch.Tensor)
                        else t, out)


@contextlib.contextmanager
def _cuda_api():
    """torch.cuda's device queries as the traced GPU answers them (the CPU shims of mcore/cpu.py
    answer the rest: synchronize, RNG state)."""
    cuda = torch.cuda
    saved = {n: getattr(cuda, n) for n in ("current_device", "is_available", "device_count",
                                           "_lazy_init")}
    cuda.current_device = lambda: CUDA
    cuda.device_count = lambda: 1
    # a factory asked for `cuda` where the function mode is not active (code run inside a torch
    # function's handler, such as the backward a full recompute starts) reaches the dispatch
    # mode, which places it on the meta device, instead of initialising CUDA
    cuda._lazy_init = lambda: None
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(cuda, name, fn)


# Megatron's torch.compile'd functions (megatron.core.jit.jit_fuser): one fused kernel each on a GPU
FUSION_MODULES = ("megatron.core.fusions.fused_bias_swiglu", "megatron.core.fusions.fused_bias_geglu",
                  "megatron.core.fusions.fused_bias_gelu", "megatron.core.fusions.fused_bias_dropout")


@contextlib.contextmanager
def _fused_kernels(ledger: Ledger):
    """Each function Megatron compiles with torch.compile (its jit_fuser: bias-SwiGLU forward and
    backward, bias-dropout-add) runs as one kernel on a GPU: inside, ledger.fused() keeps only
    what it returns (eagerly, its pointwise steps would each allocate a tensor)."""
    import importlib

    for name in FUSION_MODULES:
        importlib.import_module(name)
    patched = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None:
            continue
        for attr, fn in list(vars(module).items()):
            original = getattr(fn, "_torchdynamo_orig_callable", None)
            if original is None or not callable(original):
                continue

            def kernel(*args, __original=original, __name=attr, **kwargs):
                census = ledger.census
                if census is None:
                    with ledger.fused():
                        return __original(*args, **kwargs)
                census.fused_depth += 1
                try:
                    with ledger.fused():
                        out = __original(*args, **kwargs)
                finally:
                    census.fused_depth -= 1
                _census_kernel(ledger, __name, tensors_in((args, kwargs.values())),
                               tensors_in(out))
                return out

            setattr(module, attr, kernel)
            patched.append((module, attr, fn))
    try:
        yield
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)


@contextlib.contextmanager
def _storage_resizes(ledger: Ledger):
    """UntypedStorage.resize_ (not a dispatched op) reported to the ledger: Megatron's
    CheckpointWithoutOutput (selective layernorm recompute) frees outputs that way."""
    own = torch.UntypedStorage.__dict__.get("resize_")  # None: torch's own, inherited
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        if storage.device.type == "meta":
            ledger.resized(storage, int(size))
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        if own is None:  # left as torch had it: inherited, not a copy in the class
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = own


@contextlib.contextmanager
def traced_device(ledger: Ledger, stack: Stack, device_type: str = "cuda"):
    """Run the enclosed code with its GPU played by the meta device, every allocation in
    `ledger` (module docstring); torch.compile'd functions run eagerly; `stack` says which CUDA
    kernels to mimic. `device_type` "cpu": a CPU run traced instead (the code takes its CPU
    paths, every floating tensor is meta and counted, no host and device apart): what tests
    compare with a real CPU run's allocations."""
    import torch._dynamo

    from megatron_chunkflow.mcore.cpu import install_cpu_shims, native_torch

    install_cpu_shims()
    cpu = device_type == "cpu"
    with contextlib.ExitStack() as es:
        es.enter_context(native_torch())  # this mode places "cuda", not the CPU shims
        es.enter_context(torch._dynamo.config.patch(disable=True))
        if not cpu:
            es.enter_context(_cuda_api())
            es.enter_context(stack.applied())
            es.enter_context(_fused_kernels(ledger))
        es.enter_context(_storage_resizes(ledger))
        es.enter_context(_Functions(ledger, stack, cpu))
        es.enter_context(_Dispatch(ledger, cpu))
        yield ledger
