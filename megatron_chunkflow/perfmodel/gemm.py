"""GEMM seconds from first principles (perfmodel/layer.py's first bullet): the output cut into
tiles (the best of a few CUTLASS-like shapes, split-K when there are fewer tiles than SMs), tile
and wave quantization, and a per-tile fill and epilogue worth K_OVERHEAD K-elements; compute- or
memory-bound, whichever is slower.
"""

from __future__ import annotations

import math
from functools import lru_cache

from megatron_chunkflow.perfmodel.hardware import Hardware

GEMM_TILES = ((128, 256), (256, 128), (128, 128), (64, 128), (128, 64))
SPLIT_K = (1, 2, 4, 8, 16)
K_OVERHEAD = 128  # per-tile fill + epilogue, in K elements (about two 64-wide main-loop steps)


@lru_cache(maxsize=65536)
def gemm_shape_factor(m: int, n: int, k: int, num_sms: int) -> float:
    """Tile x wave x k efficiency of an (m x k) @ (k x n) GEMM, in (0, 1]; 1 when num_sms = 0."""
    if num_sms == 0:
        return 1.0
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        tile_eff = m * n / (tiles * tm * tn)
        for split in SPLIT_K:
            k_slice = math.ceil(k / split)
            if split > 1 and (k_slice < 4 * K_OVERHEAD or tiles >= num_sms):
                break
            units = tiles * split
            wave_eff = units / (math.ceil(units / num_sms) * num_sms)
            best = max(best, tile_eff * wave_eff * k_slice / (k_slice + K_OVERHEAD))
    return best


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware) -> float:
    """Fraction of peak an (m x k) @ (k x n) GEMM reaches on `hw` (<= hw.gemm_max_eff)."""
    return hw.gemm_max_eff * gemm_shape_factor(m, n, k, hw.num_sms)


def gemm_time(m: int, n: int, k: int, hw: Hardware) -> float:
    """Seconds of an (m x k) @ (k x n) GEMM: compute- or memory-bound, whichever is slower."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    nbytes = hw.dtype_bytes * (m * k + k * n + m * n)
    return max(flops / (hw.peak_flops * gemm_efficiency(m, n, k, hw)),
               nbytes / (hw.hbm_gb_s * 1e9 * hw.mem_eff))
