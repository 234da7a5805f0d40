"""Shims that let Megatron-LM's training package (pretrain_gpt.py, megatron/training at tag
core_v0.16.1) run on CPU with gloo: tests and CPU demos of the launcher.

megatron/training asserts CUDA in initialize_megatron and creates streams, events and memory
reports around the step; on CPU these are answered as a single-device machine with no memory
statistics. Only the launcher installs these (plugin.install, launch.py), and only without a real
GPU: megatron-core's own shims (mcore/cpu.py) come first.
"""

from __future__ import annotations

import torch

from megatron_chunkflow.mcore.cpu import has_real_cuda, install_cpu_shims


def install_megatron_lm_cpu_shims() -> bool:
    """Everything install_cpu_shims does, plus what megatron/training (core_v0.16.1) needs on CPU
    (what pretrain_gpt.py hits on CPU): returns True if installed, False on a CUDA machine."""
    import os
    import sys
    import types

    if has_real_cuda():
        return False
    install_cpu_shims()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda = torch.cuda
    cuda.is_available = lambda: True  # initialize_megatron asserts it
    cuda.device_count = lambda: 1  # parallel_state groups are built only for a positive count
    cuda.set_device = lambda *a, **k: None
    cuda.current_device = lambda: 0  # mapped to CPU by the TorchFunctionMode wherever it is used
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    # --log-memory-to-tensorboard reads these keys; there is no CUDA memory on CPU
    cuda.memory_stats = lambda *a, **k: dict.fromkeys(
        ("reserved_bytes.all.current", "allocated_bytes.all.current", "allocated_bytes.all.peak",
         "allocation.all.current"), 0)
    cuda.reset_peak_memory_stats = cuda.empty_cache = lambda *a, **k: None
    cuda.set_stream = lambda *a, **k: None  # 0.19 initialize.py _initialize_distributed
    try:
        import triton  # noqa: F401
    except ImportError:  # initialize.py imports Megatron's triton kernels; never used on CPU
        stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")

        def enable_batch_invariant_mode(*a, **k):
            raise RuntimeError("batch-invariant kernels need triton and a GPU")

        stub.enable_batch_invariant_mode = enable_batch_invariant_mode
        sys.modules[stub.__name__] = stub
    _parameters_name_cuda_types()
    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None  # no C++ build on CPU: the wheel's, or none used
    return True


_CUDA_TYPE_NAMES = {f"torch.{kind}Tensor": f"torch.cuda.{kind}Tensor"
                    for kind in ("Float", "Half", "BFloat16")}


def _parameters_name_cuda_types() -> None:
    """Megatron's mixed-precision and distributed optimizers sort parameters by `param.type()`
    ('torch.cuda.FloatTensor', ...) and refuse any other name: a CPU parameter answers with the
    CUDA name of its dtype (a conversion, `param.type(dtype)`, is untouched)."""
    parameter = torch.nn.Parameter
    if getattr(parameter.type, "_chunkflow", False):
        return
    tensor_type = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = tensor_type(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return tensor_type(self, dtype, non_blocking, **kwargs)

    type_._chunkflow = True
    parameter.type = type_


def spawn_children_from(module: str) -> bool:
    """Processes that multiprocessing spawns (torch_dist checkpointing's writer queue) import this
    module as their __main__ instead of the script being run: a spawned child re-imports
    pretrain_gpt.py, and with it megatron/training, before it could install these shims. Returns
    True if installed, False on a CUDA machine (where the script's own import works)."""
    import multiprocessing.spawn as spawn

    if has_real_cuda():
        return False
    if getattr(spawn.get_preparation_data, "_chunkflow_main", None) == module:
        return True
    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        data.pop("init_main_from_path", None)
        data["init_main_from_name"] = module
        return data

    get_preparation_data._chunkflow_main = module
    spawn.get_preparation_data = get_preparation_data
    return True


def install_megatron_lm_training_shims() -> None:
    """After megatron.training is importable: fused-kernel builds (nvcc; core_v0.16.1's
    initialize.py `fused_kernels.load(args)`, megatron.legacy, removed in 0.17) and the JIT warm-up
    on "cuda" tensors (training.py `set_jit_fusion_options`, every release) become no-ops on CPU."""
    import importlib.util

    if has_real_cuda():
        return
    from megatron.training import training

    if importlib.util.find_spec("megatron.legacy") is not None:
        from megatron.legacy import fused_kernels

        fused_kernels.load = lambda *a, **k: None
    training.set_jit_fusion_options = lambda *a, **k: None
