"""Megatron-LM jobs whose ranks are forked from a process that has already imported what every
rank imports: the launcher tests' way to start pretrain_gpt.py without paying ~7 s of torch,
megatron-core and megatron/training imports per rank (most of a tiny test run's cost).

    run = fork_job(2, "megatron_chunkflow.launch", [pretrain_gpt.py, *args], cwd=workdir)
    run.returncode, run.stdout, run.stderr       # as subprocess.run(..., capture_output=True)

A job is what torchrun starts: `nproc` processes with torchrun's environment (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/PORT; OMP_NUM_THREADS=1 for more than
one process), each running `python -m MODULE ARGV` as __main__ in `cwd`; when a rank fails the
others are stopped, as torchrun stops them, and a job that outlives its timeout is killed whole.

The ranks are forked by a server process of this module (`python -m tests.megatron_lm.forked`,
one per test process, started on first use) that imports what the launcher imports first: its
CPU shims (megatron_lm/cpu.py, installed as the launcher installs them, before anything else),
megatron-core and the checkout's megatron/training. Nothing is initialised there (no process
group, no parallel_state, no thread pool), so a forked rank starts where a fresh one is after its
imports. The launcher tests keep one job on torchrun itself (`_torchrun(..., real=True)`).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from megatron_chunkflow import compat

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_LM = Path(os.environ.get(
    "MEGATRON_LM_DIR", ROOT / "third_party" / f"Megatron-LM-{compat.megatron_lm_tag()}"))
FAILURE_GRACE_S = 5.0  # after one rank fails, how long the others get before they are stopped


def fork_job(nproc: int, module: str, argv: list[str], cwd, env: dict | None = None,
             timeout: float = 600, rank_env: dict | None = None):
    """`torchrun --nproc_per_node nproc -m module argv` in `cwd` (with `rank_env`, one process not
    started by torchrun, with that environment added: `nproc` must be 1); returns a
    CompletedProcess with the ranks' output, rank 0's first. A rendezvous port taken between
    free_port() and the store's bind (the tests' other jobs open connections too) is tried once
    more with another port."""
    run = _fork_job(nproc, module, argv, cwd, env, timeout, rank_env)
    if rank_env is None and run.returncode != 0 and "EADDRINUSE" in run.stderr:
        run = _fork_job(nproc, module, argv, cwd, env, timeout, rank_env)
    return run


def _fork_job(nproc, module, argv, cwd, env, timeout, rank_env):
    from megatron_chunkflow.mcore.dist import free_port

    base = {**os.environ, **(env or {})}
    if rank_env is None:
        port = str(free_port())
        envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                 "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                 "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                 **({"OMP_NUM_THREADS": "1"} if nproc > 1 else {})} for r in range(nproc)]
    else:
        assert nproc == 1, "rank_env: one process"
        envs = [{**base, **rank_env}]
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(f"{tmp}/{r}.out", f"{tmp}/{r}.err") for r in range(nproc)]
        code = _server().run({"module": module, "argv": [str(a) for a in argv], "envs": envs,
                              "cwd": str(cwd), "logs": logs, "timeout": timeout})
        out, err = ("".join(Path(log[i]).read_text(errors="replace") for log in logs
                            if Path(log[i]).is_file()) for i in (0, 1))
    if code is None:
        raise subprocess.TimeoutExpired([module, *argv], timeout, out, err)
    return subprocess.CompletedProcess([module, *argv], code, out, err)


class _Server:
    """The client end: one JSON line per job each way."""

    def __init__(self):
        self.log = Path(tempfile.gettempdir()) / f"chunkflow_forked_{os.getpid()}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__], cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        atexit.register(self.close)

    def run(self, job: dict) -> int | None:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (code {self.proc.wait()}): "
                               + self.log.read_text(errors="replace")[-3000:])
        return json.loads(line)["code"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_SERVER: _Server | None = None


def _server() -> _Server:
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        _SERVER = _Server()
    return _SERVER


# ---- the server ----------------------------------------------------------------------------------


def _warm() -> None:
    """What every launched rank imports first."""
    from megatron_chunkflow.megatron_lm.cpu import install_megatron_lm_cpu_shims

    install_megatron_lm_cpu_shims()
    compat.backport_typing_override()  # as plugin.install does: 0.19's training package on 3.11
    if (MEGATRON_LM / "pretrain_gpt.py").is_file():
        sys.path.insert(0, str(MEGATRON_LM))
        import megatron.training.training  # noqa: F401
    import gc

    gc.collect()
    gc.freeze()  # ranks' collections leave the inherited objects (and their pages) alone


def _rank(module: str, argv: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In a forked child: `python -m module argv`, its output to `out` / `err`; never returns."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills what it started too
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        threads = env.get("OMP_NUM_THREADS")
        if threads:  # the thread pool read it when torch loaded, in the server: set it here
            import torch

            torch.set_num_threads(int(threads))
        null = os.open(os.devnull, os.O_RDONLY)
        o, e = (os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in (out, err))
        for fd, target in ((null, 0), (o, 1), (e, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = [module, *argv]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as x:
            code = x.code if isinstance(x.code, int) else (0 if x.code is None else 1)
            if isinstance(x.code, str):
                print(x.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001  as the interpreter reports an uncaught exception
            traceback.print_exc()
        atexit._run_exitfuncs()  # what a normal interpreter exit runs
        sys.stdout.flush(), sys.stderr.flush()
    finally:
        os._exit(code)


def _serve_job(job: dict) -> int | None:
    """Fork the job's ranks and wait for them: the first failing rank's exit status, 0, or None
    when the timeout passed (every rank killed)."""
    pids = []
    for env, (out, err) in zip(job["envs"], job["logs"]):
        pid = os.fork()
        if pid == 0:
            _rank(job["module"], job["argv"], env, job["cwd"], out, err)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, failed_at, first_failure = time.monotonic() + job["timeout"], None, 0
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                    if codes[pid] != 0 and failed_at is None:
                        failed_at, first_failure = time.monotonic(), codes[pid]
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE_S):
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if failed_at is None:
                _end_groups(pids)
                return None
        time.sleep(0.01)
    _end_groups(pids)
    return first_failure


def _end_groups(pids) -> None:
    """What the ranks left running in their process groups (torch_dist's spawned checkpoint
    writers), ended as torchrun ends a job's processes: none outlives its test."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> int:
    replies = os.fdopen(os.dup(1), "w")  # the protocol; what the imports print goes to stderr
    os.dup2(2, 1)
    _warm()
    for line in sys.stdin:
        code = _serve_job(json.loads(line))
        replies.write(json.dumps({"code": code}) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
