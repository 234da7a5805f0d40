"""`python -m megatron_chunkflow` is the `chunkflow` command."""

import sys

from megatron_chunkflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
