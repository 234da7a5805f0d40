"""Layer specs for Megatron-LM's --spec flag, built from megatron-core's local modules (no
Transformer Engine: CPU runs, or a GPU machine without it):

    pretrain_hybrid.py ... --spec megatron_chunkflow.megatron_lm.specs local_stack_spec
    pretrain_hybrid.py ... --spec megatron_chunkflow.megatron_lm.specs local_qk_norm_stack_spec

Megatron-LM core_v0.19.0 builds pretrain_hybrid.py's layers from Transformer Engine's modules
whatever --transformer-impl says; these are mcore/hybrid.py's attention + MLP layers (Qwen3's Q/K
norms in the second). Megatron-LM reads the module's attributes, so they are built on import.
"""

from megatron_chunkflow.mcore.hybrid import local_hybrid_spec

local_stack_spec = local_hybrid_spec(qk_norm=False)
local_qk_norm_stack_spec = local_hybrid_spec(qk_norm=True)
