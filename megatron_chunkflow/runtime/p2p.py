"""Sends and receives between neighbouring pipeline stages: the one module that touches Megatron's
private point-to-point API.

    link = StageLink(pp_group, config)           # PP >= 2 only
    x = link.recv_forward((t, 1, h))             # blocks
    link.send_forward(y)                         # posted, returns at once
    link.wait()                                  # end of the step: every send completed

- Shapes: every rank knows every chunk's length from the plan, so a receive allocates the exact
  [t (/ TP under sequence parallelism), 1, h]; nothing is padded to the chunk size and no shape is
  exchanged (config.variable_seq_lengths off: Megatron's handshake would add a blocking message).
- Sends are asynchronous: P2PCommunicator._communicate(..., wait_on_reqs=False), which needs
  config.batch_p2p_comm off, from a copy of the tensor (so the caller may free it at once, e.g.
  deallocate_output_tensor); the requests are waited in `wait`. Receives block. A plan that
  replays under asynchronous sends (core/simulate.py) therefore cannot deadlock, and because
  every stage forwards in one order and backwards in another shared order, messages between two
  stages are received in the order they are sent (NCCL matches them by order, not by tag).
"""

from __future__ import annotations

import torch


class StageLink:
    """This stage's point-to-point traffic for one step."""

    def __init__(self, pp_group, config, communicator=None):
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config.batch_p2p_comm = False  # _communicate(wait_on_reqs=False) needs single ops
        config.variable_seq_lengths = False  # receivers know the shapes from the plan
        self._p2p = communicator or P2PCommunicator(pp_group, config)
        self._pending: list[tuple[torch.Tensor, object]] = []  # (buffer, requests) in flight

    def recv_forward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The previous stage's output for the next forward on this stage."""
        return self._p2p.recv_forward(shape, False)

    def recv_backward(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next stage's input gradient for the next backward on this stage."""
        return self._p2p.recv_backward(shape, False)

    def send_forward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, forward=True)

    def send_backward(self, tensor: torch.Tensor) -> None:
        self._send(tensor, forward=False)

    def _send(self, tensor: torch.Tensor, forward: bool) -> None:
        buf = tensor.detach().clone()
        _, _, reqs = self._p2p._communicate(
            tensor_send_next=buf if forward else None, tensor_send_prev=None if forward else buf,
            recv_prev=False, recv_next=False, tensor_shape=None, wait_on_reqs=False)
        self._pending.append((buf, reqs))

    def wait(self) -> None:
        """Block until every send posted so far has completed."""
        for _, reqs in self._pending:
            for req in (reqs.values() if isinstance(reqs, dict) else reqs or []):
                req.wait()
        self._pending.clear()


def comm_device() -> torch.device:
    """Where this job's collectives take tensors: the current GPU under NCCL, else the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
