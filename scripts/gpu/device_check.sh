#!/usr/bin/env bash
# The device check on a bare GPU machine, in at most 8 minutes: install the wheels that
# `make gpu-wheels` downloaded into .whl/ (megatron-core and the project's pure-Python
# dependencies; PyTorch and Triton are the machine's), then run scripts/gpu/device_check.py.
#
#   bash scripts/gpu/device_check.sh --out "$OUT"          # on the GPU machine, from the repo root
#   bash scripts/gpu/device_check.sh --out DIR --dry-run   # here, on CPU (what the tests run)
#
# Every argument goes to device_check.py. Exit status: device_check.py's (0: every step ok).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
if [[ -d .whl ]] && compgen -G ".whl/*.whl" > /dev/null; then
    site=${DEVICE_CHECK_SITE:-/tmp/device_check_site}
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout "${DEVICE_CHECK_TIMEOUT_S:-480}" "$PYTHON" scripts/gpu/device_check.py "$@"
