"""Run Megatron-LM's pretrain_gpt.py with the ChunkFlow plugin installed.

    python -m megatron_chunkflow.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron args> \\
        --chunkflow --chunk-size 8192 --chunkflow-k 2
    torchrun --nproc_per_node 8 -m megatron_chunkflow.launch pretrain_gpt.py ...   # any launcher
    chunkflow-megatron pretrain_gpt.py ...                                          # the same

The script itself is not modified: the plugin patches megatron/training (megatron_lm/plugin.py)
and then runs the script as __main__ (megatron_lm/launcher.py). Without --chunkflow, the run is
stock Megatron-LM. A fork that patches pretrain_gpt.py instead
(patches/pretrain_gpt.chunkflow.patch) calls `install`.
"""

from __future__ import annotations

import sys


def install(megatron_lm_dir, allow_untested: bool | None = None) -> None:
    """Install the plugin's hooks into megatron/training of the Megatron-LM checkout at
    `megatron_lm_dir` (the directory of pretrain_gpt.py); idempotent."""
    from megatron_chunkflow.megatron_lm.plugin import install as install_plugin

    install_plugin(megatron_lm_dir, allow_untested)


def main(argv: list[str] | None = None) -> int:
    from megatron_chunkflow.megatron_lm.launcher import launch

    return launch(list(sys.argv[1:] if argv is None else argv),
                  __spec__.name if __spec__ else "megatron_chunkflow.launch", __doc__)


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":  # a process multiprocessing spawned from a CPU run
    from megatron_chunkflow.megatron_lm.cpu import install_megatron_lm_cpu_shims

    install_megatron_lm_cpu_shims()
