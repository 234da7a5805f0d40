"""Long-lived gloo jobs for the tests: each world size is started once per session and reused.

    def test_x(gloo):                        # the session fixture (tests/conftest.py)
        results = gloo.run(fn, 2, arg)       # fn(arg) on every rank of a 2-process job
        code, out, err = gloo.cli(2, "verify", "--cp", 2, "--json")   # chunkflow's main

Starting a job (spawning Python, importing torch and megatron-core, the gloo rendezvous) costs
more than many of the tests that run in it, so the tests of one world size share a job. Each rank
runs one call at a time: the call's function builds Megatron's process groups for its layout
(mcore/dist.init_distributed joins the job's default group, and its shutdown leaves that group to
the job), and after every call the worker tears down what the call built (Megatron's groups and
their gloo subgroups) and restores the process (default dtype, grad mode, threads, environment,
working directory, freed heap). A call that fails or hangs on any rank ends its job, since a
collective may be left half done; the next call starts a new one. What the ranks print goes to one
file per rank and call, written to the test's stderr afterwards (capfd and capsys see it), also
for a rank that never reported: a hang's last lines (CHUNKFLOW_TRACE) are not lost.

Each rank uses cores / world_size threads, divided again among pytest-xdist's workers: on 2 cores,
a 4-process job would otherwise run 8 threads.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from megatron_chunkflow.mcore.dist import free_port, process_context

FAILURE_GRACE_S = 5.0  # after one rank fails, how long the others get to report


def _pytest_workers() -> int:
    """How many pytest processes share the machine (pytest-xdist's -n; 1 without it)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    """One rank of a job: join the default process group once, then run calls until None."""
    threads = max(1, (os.cpu_count() or 1) // world_size // _pytest_workers())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      OMP_NUM_THREADS=str(threads))
    import warnings

    import torch

    from megatron_chunkflow.mcore.dist import start_job

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    torch.set_num_threads(threads)
    start_job()
    environ, cwd = dict(os.environ), os.getcwd()
    while (task := tasks.get()) is not None:
        fn, args, log = task
        with open(log, "wb") as out:
            status, value = _call(fn, args, out.fileno())
        results.put((status, rank, value))
        try:
            _reset(environ, cwd, threads)
        except BaseException:  # noqa: BLE001  a process that cannot be reset serves no more
            traceback.print_exc()
            return


def _call(fn, args, fd: int) -> tuple[str, object]:
    """fn(*args) with this process's stdout and stderr written to `fd`."""
    saved = [os.dup(1), os.dup(2)]
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)
    try:
        return "ok", fn(*args)
    except ValueError as e:  # bad input: every rank raises the same
        return "value", str(e)
    except BaseException:  # noqa: BLE001  reported; the job then ends
        return "error", traceback.format_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for f in saved:
            os.close(f)


def _reset(environ: dict, cwd: str, threads: int) -> None:
    """Leave the process as the next call expects it: no Megatron groups, float32 by default,
    grad on, the job's threads, environment and working directory, freed heap returned."""
    import ctypes
    import gc

    import torch

    from megatron_chunkflow.mcore.dist import shutdown

    shutdown()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Job:
    """`world_size` processes forming one torch.distributed job."""

    def __init__(self, world_size: int):
        ctx = process_context()  # on CPU forked from a server that imported torch and mcore
        self.world_size = world_size
        self.results = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.logs = Path(tempfile.mkdtemp(prefix=f"gloo{world_size}_"))
        self.calls = 0
        port = free_port()
        # not daemons: a call may start processes of its own (dist_checkpointing's writer)
        self.procs = [ctx.Process(target=_serve,
                                  args=(r, world_size, port, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        atexit.register(self.close, graceful=False)  # a session that ends without teardown

    def run(self, fn, args, timeout: float) -> list:
        """Every rank's fn(*args); raises as GlooJobs.run says."""
        self.calls += 1
        logs = [self.logs / f"call{self.calls}.rank{r}.log" for r in range(self.world_size)]
        for q, log in zip(self.tasks, logs):
            q.put((fn, args, str(log)))
        done: dict[int, tuple[str, object]] = {}
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while len(done) < self.world_size:
                if not self.results.empty():
                    status, rank, value = self.results.get()
                    done[rank] = (status, value)
                    if status != "ok" and failed_at is None:
                        failed_at = time.monotonic()
                    continue
                now = time.monotonic()
                if failed_at is not None and now > failed_at + FAILURE_GRACE_S:
                    break  # the others are likely stuck in a collective with the failed rank
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]} "
                                       "without reporting (killed?)")
                if now > deadline:
                    raise TimeoutError(f"the job did not finish in {timeout:.0f} s")
                time.sleep(0.01)
        finally:  # what every rank printed, the ones that never reported included
            for log in logs:
                if log.exists():
                    sys.stderr.write(log.read_bytes().decode("utf-8", "replace"))
                    log.unlink()
            sys.stderr.flush()
        failed = sorted((r, s, v) for r, (s, v) in done.items() if s != "ok")
        if failed:
            rank, status, value = failed[0]
            if status == "value":
                every_rank = len(failed) == self.world_size
                raise (_BadInput if every_rank else ValueError)(value)
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        return [done[r][1] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        atexit.unregister(self.close)
        if graceful and all(p.is_alive() for p in self.procs):
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                for child in _children(p.pid):  # a rank ending normally shuts these down itself
                    _kill(child)
                p.terminate()
                p.join(timeout=10)
        shutil.rmtree(self.logs, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; none found elsewhere): what a rank
    started of its own, such as the Manager process that dist_checkpointing's torch_dist writer
    spawns for its results, which a terminated rank would leave running."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `chunkflow ARGV` run in this process, as every rank of a job
    runs it under torchrun (GlooJobs.cli)."""
    import contextlib
    import io

    from megatron_chunkflow.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


class _BadInput(ValueError):
    """Every rank raised ValueError: the job is still sound and stays up."""


class GlooJobs:
    """One long-lived job per world size (see the module docstring)."""

    def __init__(self):
        self._jobs: dict[int, _Job] = {}

    def run(self, fn, world_size: int, *args, timeout: float = 600) -> list:
        """fn(*args) on every rank of the `world_size` job; every rank's result, in rank order.

        As mcore/dist.run_processes: a ValueError raised in the job is raised again here with its
        message; any other exception, a rank that dies or `timeout` seconds passing raises
        RuntimeError (TimeoutError) with the failing rank's traceback. The job is then ended and
        the next call starts a new one, unless every rank raised ValueError (bad input, refused
        alike everywhere). `fn` and `args` must be picklable."""
        job = self._jobs.get(world_size)
        if job is None:
            job = self._jobs[world_size] = _Job(world_size)
        try:
            return job.run(fn, args, timeout)
        except _BadInput:
            raise  # every rank refused the same input: none is left inside a collective
        except BaseException:
            del self._jobs[world_size]
            job.close(graceful=False)
            raise

    def cli(self, world_size: int, *argv, timeout: float = 600) -> tuple[int, str, str]:
        """`chunkflow ARGV` on every rank of the `world_size` job, as torchrun would run it: rank
        0's (exit code, stdout, stderr)."""
        return self.run(cli, world_size, [str(a) for a in argv], timeout=timeout)[0]

    def close(self) -> None:
        for job in self._jobs.values():
            job.close()
        self._jobs.clear()
