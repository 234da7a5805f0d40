"""Many runs of the Megatron-LM launcher that are refused before Megatron builds anything, in one
Python process: each case's exit code and what it printed, so a test of a refusal does not pay
for a process of its own (torch, megatron-core and Megatron-LM imports, ~6 s each).

    python -m tests.megatron_lm.refusals SPEC.json    # prints one JSON list, a result per case

SPEC.json: {"cwd": DIR, "cases": [{"argv": [pretrain_gpt.py, args...], "env": {...}}, ...]}.
Each case runs megatron_chunkflow.launch's main with its environment (RANK, WORLD_SIZE, ... as
`tests/megatron_lm/test_pretrain_gpt.py: _launch_one` sets them); what a case leaves behind
(Megatron-LM's global variables, process groups) is cleared before the next. A case that raises
instead of exiting reports "traceback" and the traceback as its output.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def run_case(argv: list[str], env: dict) -> dict:
    from megatron_chunkflow.launch import main

    saved_env, saved_argv = dict(os.environ), list(sys.argv)
    os.environ.update(env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)  # what C code and warnings print too
        try:
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001  reported as the case's result
                code = "traceback"
                traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.argv = saved_argv
            _clear()
        out.seek(0), err.seek(0)
        return {"code": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def _clear() -> None:
    """What a refused run may have set up: Megatron-LM's globals and any process group."""
    import torch.distributed as dist

    try:
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator,
        )
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine
        from megatron.training import global_vars

        global_vars.destroy_global_vars()
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
    except ImportError:
        pass
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    os.chdir(spec["cwd"])
    results = [run_case(case["argv"], case.get("env", {})) for case in spec["cases"]]
    sys.stdout.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
