"""Long-lived gloo jobs for the tests: each world size is spawned once per session and reused.

    def test_x(gloo):                        # the session fixture (tests/conftest.py)
        results = gloo.run(fn, 2, arg)       # fn(arg) on every rank of a 2-process job

Starting a job (spawning Python, importing torch and megatron-core, the gloo rendezvous) costs
more than most of the tests that run in it, so every test of one world size shares a job. Each
rank serves one function call at a time: the calling test's function initialises Megatron's
process groups for its layout (megatron_chunkflow.mcore.dist.init_distributed reuses the job's
default group; its shutdown() leaves that group alone) and the worker then tears down what the
call built (Megatron's parallel state and its subgroups) and restores process state (default
dtype, threads, environment). A call that fails or hangs on any rank ends the whole job (a
collective may be left half-done); the next call starts a fresh one. What a rank prints is
captured per call and replayed in the test's process, so capfd/capsys see it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from megatron_chunkflow.mcore.dist import free_port


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    """One rank of a job: form the default process group once, then run calls until told to
    stop."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS=str(threads))
    import torch

    from megatron_chunkflow.mcore.dist import start_job

    torch.set_num_threads(threads)
    start_job()
    environ = dict(os.environ)
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, args = task
        with tempfile.TemporaryFile() as out:
            saved = [os.dup(1), os.dup(2)]
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out.fileno(), 1), os.dup2(out.fileno(), 2)
            try:
                status, value = "ok", fn(*args)
            except ValueError as e:  # bad input: every rank raises the same
                status, value = "value", str(e)
            except BaseException:  # noqa: BLE001  reported, then this job ends
                status, value = "error", traceback.format_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
            out.seek(0)
            printed = out.read().decode("utf-8", "replace")
        _reset(environ, threads)
        results.put((status, rank, value, printed))


def _reset(environ: dict, threads: int) -> None:
    """Leave the process as the call found it: no Megatron groups, float32, the same threads and
    environment."""
    import gc

    import torch

    from megatron_chunkflow.mcore.dist import shutdown

    shutdown()
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()


class _Job:
    """`world_size` spawned processes forming one torch.distributed job."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, daemon=True,
                                  args=(r, world_size, port, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, timeout: float) -> list:
        for q in self.tasks:
            q.put((fn, args))
        done: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            if not self.results.empty():
                status, rank, value, printed = self.results.get()
                done[rank] = (status, value, printed)
                continue
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and self.results.empty():
                self._replay(done)
                raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} "
                                   "without reporting (killed?)")
            if any(status != "ok" for status, _, _ in done.values()):
                # the failing rank's partners may be stuck in a collective: give them a moment
                if time.monotonic() > min(deadline, self._failed_at + 5.0):
                    break
            elif time.monotonic() > deadline:
                self._replay(done)
                raise TimeoutError(f"the job did not finish in {timeout:.0f} s")
            if any(status != "ok" for status, _, _ in done.values()) and \
                    not hasattr(self, "_failed_at_set"):
                self._failed_at, self._failed_at_set = time.monotonic(), True
            time.sleep(0.02)
        self._replay(done)
        failed = sorted((r, s, v) for r, (s, v, _) in done.items() if s != "ok")
        if failed:
            rank, status, value = failed[0]
            if status == "value":
                raise _JobValueError(value)
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        return [done[r][1] for r in range(self.world_size)]

    _failed_at = float("inf")

    @staticmethod
    def _replay(done: dict) -> None:
        for rank in sorted(done):
            printed = done[rank][2]
            if printed:
                sys.stderr.write(printed)
        sys.stderr.flush()

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


class _JobValueError(ValueError):
    """A ValueError raised in the job (bad input), re-raised in the test with its message."""


class GlooJobs:
    """One long-lived job per world size (see the module docstring)."""

    def __init__(self):
        self._jobs: dict[int, _Job] = {}

    def run(self, fn, world_size: int, *args, timeout: float = 600) -> list:
        """fn(*args) on every rank of the `world_size` job; every rank's result, in rank order.

        As mcore.dist.run_processes: a ValueError in the job is re-raised with its message; any
        other exception, a rank that dies or the timeout raises RuntimeError (TimeoutError) with
        the failing rank's traceback, and then the job is ended (the next call starts anew)."""
        job = self._jobs.get(world_size)
        if job is None:
            job = self._jobs[world_size] = _Job(world_size)
        try:
            return job.run(fn, args, timeout)
        except BaseException:
            del self._jobs[world_size]
            job.close(graceful=False)
            raise

    def close(self) -> None:
        for job in self._jobs.values():
            job.close()
        self._jobs.clear()
