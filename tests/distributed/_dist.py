"""run_gloo: run a function in `world_size` fresh processes (torch.multiprocessing spawn, gloo).

Every run has a timeout, and an exception on any rank ends all ranks and is re-raised here with the
rank's traceback. Results come back through a queue, one per rank: fn(rank, *args) -> picklable.
"""

from __future__ import annotations

import os
import time
import traceback

import torch.multiprocessing as mp

from megatron_chunkflow.training.dist import free_port as _free_port




def _entry(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise


def run_gloo(fn, world_size: int, *args, timeout: float = 300.0):
    """Returns [fn's result on rank 0, ..., on rank world_size - 1]."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if not queue.empty():
                rank, status, value = queue.get()
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                results[rank] = value
                continue
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise RuntimeError(f"a rank died with exit code {dead[0].exitcode} "
                                   "without reporting (killed?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f} s")
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    return [results[r] for r in range(world_size)]
