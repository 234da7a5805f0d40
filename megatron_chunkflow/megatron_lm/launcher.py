"""The launcher behind `python -m megatron_chunkflow.launch` (launch.py, the documented entry
point): check the script, set up a one-process job when no launcher did, install the plugin into
the Megatron-LM checkout next to the script and run the unmodified script as __main__.

A LaunchError (bad flags or data) is printed as one line and exits 2, without a traceback.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

USAGE = ("usage: python -m megatron_chunkflow.launch PATH/TO/pretrain_gpt.py [Megatron-LM args] "
         "[--chunkflow --chunk-size N --chunkflow-k K]")


def launch(argv: list[str], entry_module: str, doc: str) -> int:
    """Run `argv` = [pretrain_gpt.py, Megatron-LM args...]; `entry_module` is the module name that
    processes spawned by the run (torch_dist checkpointing's writer) import as their __main__,
    `doc` the entry point's help text."""
    if not argv or argv[0] in ("-h", "--help"):
        print(doc.strip() + "\n\n" + USAGE, file=sys.stderr)
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"chunkflow-megatron: error: {script}: no such script (give the path of "
              "Megatron-LM's pretrain_gpt.py)\n" + USAGE, file=sys.stderr)
        return 2
    from megatron_chunkflow.megatron_lm.cpu import spawn_children_from
    from megatron_chunkflow.megatron_lm.plugin import LaunchError, install

    single_process_defaults()
    spawn_children_from(entry_module)
    try:
        install(script.resolve().parent,
                allow_untested="--chunkflow-allow-untested-megatron" in argv)
        sys.argv = [str(script)] + argv[1:]
        runpy.run_path(str(script), run_name="__main__")
    except LaunchError as e:  # every rank refuses the same input: the first one says so
        if os.environ.get("RANK", "0") == "0":
            print(f"chunkflow-megatron: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def single_process_defaults() -> None:
    """Without torchrun/srun: a one-process job on this machine (Megatron reads env://)."""
    from megatron_chunkflow.mcore.dist import free_port

    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
