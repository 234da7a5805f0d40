"""Run Megatron-LM's pretrain_gpt.py with the ChunkFlow plugin installed.

    python -m megatron_chunkflow.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron args> \\
        --chunkflow --chunk-size 8192 --chunkflow-k 2
    torchrun --nproc_per_node 8 -m megatron_chunkflow.launch pretrain_gpt.py ...   # any launcher
    chunkflow-megatron pretrain_gpt.py ...                                          # the same

The script itself is not modified: the plugin patches megatron/training (megatron_lm/plugin.py)
and then runs the script as __main__. Without --chunkflow, the run is stock Megatron-LM. A fork
that patches pretrain_gpt.py instead (patches/pretrain_gpt.chunkflow.patch) calls `install`.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

USAGE = ("usage: python -m megatron_chunkflow.launch PATH/TO/pretrain_gpt.py [Megatron-LM args] "
         "[--chunkflow --chunk-size N --chunkflow-k K]")


def install(megatron_lm_dir, allow_untested: bool | None = None) -> None:
    """Install the plugin's hooks into megatron/training of the Megatron-LM checkout at
    `megatron_lm_dir` (the directory of pretrain_gpt.py); idempotent."""
    from megatron_chunkflow.megatron_lm.plugin import install as install_plugin

    install_plugin(megatron_lm_dir, allow_untested)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE, file=sys.stderr)
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"chunkflow-megatron: error: {script}: no such script (give the path of "
              "Megatron-LM's pretrain_gpt.py)\n" + USAGE, file=sys.stderr)
        return 2
    from megatron_chunkflow.megatron_lm.plugin import LaunchError, install

    _single_process_defaults()
    from megatron_chunkflow.training.cpu import spawn_children_from

    spawn_children_from(__spec__.name if __spec__ else "megatron_chunkflow.launch")

    try:
        install(script.resolve().parent,
                allow_untested="--chunkflow-allow-untested-megatron" in argv)
        sys.argv = [str(script)] + argv[1:]
        runpy.run_path(str(script), run_name="__main__")
    except LaunchError as e:
        print(f"chunkflow-megatron: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def _single_process_defaults() -> None:
    """Without torchrun/srun: a one-process job on this machine (Megatron reads env://)."""
    import os

    from megatron_chunkflow.training.dist import free_port

    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":  # a process multiprocessing spawned from a CPU run
    from megatron_chunkflow.training.cpu import install_megatron_lm_cpu_shims

    install_megatron_lm_cpu_shims()
