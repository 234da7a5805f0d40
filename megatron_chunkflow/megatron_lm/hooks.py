"""What the plugin's patched seams share (megatron_lm/plugin.py installs them): the step
iterator, the K/V state store of the model chunks, the Job of Megatron-LM's groups and the log
interval's totals, and Megatron-LM's parsed arguments."""

from __future__ import annotations


class Hooks:
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


HOOKS = Hooks()


def megatron_args():
    from megatron.training import get_args

    return get_args()


def print_last(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(line, flush=True)
