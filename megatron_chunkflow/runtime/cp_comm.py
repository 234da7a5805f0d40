"""Context parallelism's communication for ChunkFlow (runtime/cp.py holds the attention): the
ring's paired send and receive between neighbours, the all-gather of K/V shards whose backward
reduce-scatters their gradient (fp32 under half precision), and the bytes each rank receives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Traffic:
    """Bytes one rank receives in ChunkFlow's CP collectives, as NCCL's ring runs them:
    (CP - 1)/CP of an all-gather's output, and of a reduce-scatter's input."""

    def __init__(self):
        self.gathered = 0  # all-gathers of K/V (forwards, and again in backwards)
        self.reduce_scattered = 0  # dK/dV

    @staticmethod
    def received(t: torch.Tensor, size: int) -> int:
        return t.numel() * t.element_size() * (size - 1) // size


class Peers:
    """This rank's ring neighbours in `group`: exchange() sends to the next rank and receives
    from the previous one (one batch_isend_irecv, as NCCL needs a ring's sends and receives
    grouped); wait() returns what arrived. Every rank issues the same exchanges in the same
    order, so the sends and receives between two ranks pair up in order."""

    def __init__(self, group):
        self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)

    def exchange(self, tensor, traffic: Traffic | None, counter: str):
        return _Exchange(self, tensor.contiguous(), traffic, counter)


class _Exchange:
    def __init__(self, peers: Peers, tensor, traffic, counter):
        self.sent, self.received = tensor, torch.empty_like(tensor)  # both held until done
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, peers.next, peers.group),
            dist.P2POp(dist.irecv, self.received, peers.prev, peers.group)])
        if traffic is not None:
            setattr(traffic, counter, getattr(traffic, counter)
                    + self.received.numel() * self.received.element_size())

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.sent = None
        return self.received


def gather_chunk_kv(k, v, group, traffic: Traffic | None = None):
    """The whole K and V [cp * s, ng, hn] from every rank's shard (rank after rank), in one
    collective (the attention's gather, and a chunk's own K/V under replicated state); the
    backward reduce-scatters their gradient (fp32 under half precision)."""
    kv = _GatherKV.apply(torch.stack([k, v], dim=1), group, traffic)  # [cp * s, 2, ng, hn]
    return kv[:, 0], kv[:, 1]


# torch >= 2.12 names them *_single (the *_tensor names are deprecated)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward: reduce-scatter (summed in fp32 under half
    precision; all-reduce and slice for CPU tensors: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, traffic):
        ctx.group, ctx.dtype, ctx.traffic = group, x.dtype, traffic
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        if traffic is not None:
            traffic.gathered += Traffic.received(out, size)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        out = reduce_scatter(grad.to(wide), group, size, rank, ctx.traffic)
        return out.to(ctx.dtype), None, None


def reduce_scatter(grad, group, size: int, rank: int, traffic: Traffic | None):
    """This rank's block of the sum over `group` of `grad` [size * s, ...] (all-reduce and slice
    for CPU tensors: gloo has no reduce-scatter)."""
    if grad.device.type == "cpu":
        summed = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        out = summed.chunk(size)[rank]
    else:
        grad = grad.contiguous()
        out = grad.new_empty((grad.size(0) // size, *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad, group=group)
    if traffic is not None:
        traffic.reduce_scattered += out.numel() * out.element_size() * (size - 1)
    return out
