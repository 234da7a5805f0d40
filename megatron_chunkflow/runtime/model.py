"""Apply ChunkFlow to a built megatron-core GPTModel: swap core attention, RoPE by position ids.

    store = apply_chunkflow(model, backend="sdpa")

Works on the local and the Transformer Engine layer specs alike (it walks the built modules). After it:
- every SelfAttention's `core_attention` is a `ChunkCoreAttention`: a standalone chunk attends causally
  within each packed segment; a dependent chunk's queries attend to its sequence's stored K/V and then
  causally to its own (bottom-right aligned), through the relay of runtime/state.py. Called by a
  stock Megatron schedule (no chunk context), it is plain THD attention, causal within each packed
  sequence of packed_seq_params: what TE's THD attention computes on GPU, for the baseline on CPU;
- `rotary_pos_emb` returns per-token frequencies for the current chunk's position ids (continuing
  across a sequence's chunks, restarting at 0 per packed segment). Megatron's THD RoPE uses them one row
  per token (rope_utils._apply_rotary_pos_emb_thd, "CASE 1").
The chunk context comes from the schedule (`store.begin(meta)` around each forward), never from a global.
Under context parallelism each rank runs its zigzag shard of every chunk and attention all-gathers
K/V over the CP group (runtime/cp.py); RoPE is handed the whole chunk's positions, from which
megatron-core's THD RoPE picks this rank's rows.

Shapes: Megatron letters; THD core-attention inputs q [t, np, hn], k/v [t, ng, hn].
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from megatron_chunkflow.attention import chunk_attention, lse_pair, resolve_backend
from megatron_chunkflow.runtime import reforward
from megatron_chunkflow.runtime.cp import cp_attention
from megatron_chunkflow.runtime.cp_comm import gather_chunk_kv
from megatron_chunkflow.runtime.cp_keys import (
    KeySelection,
    hybrid_cu,
    key_selection,
    local_index,
    ring_selection,
)
from megatron_chunkflow.runtime.state import ChunkMeta, KVStateStore


class ChunkCoreAttention(torch.nn.Module):
    """Core attention over [stored prefix K/V ++ own K/V] for the data chunk being run."""

    def __init__(self, layer_number: int, softmax_scale: float, store: KVStateStore, backend: str,
                 cp_group=None):
        super().__init__()
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.__dict__["store"] = store  # not a submodule: no state_dict entries
        self.__dict__["cp_group"] = cp_group

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        meta = self.store.current
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise RuntimeError("ChunkFlow attention expects THD inputs (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported with ChunkFlow")
        t = query.size(0)
        if meta is not None and meta.cp_size > 1:
            return self._forward_cp(query, key, value, meta)
        if meta is None:  # a stock schedule (the baseline): causal within each packed sequence
            if _cp_size(self.cp_group) > 1:
                raise RuntimeError("a stock schedule with context parallelism needs Transformer "
                                   "Engine's attention; ChunkFlow's runs only ChunkFlow's chunks")
            cu_q = cu_kv = packed_seq_params.cu_seqlens_q.cpu()
        elif meta.dependent:
            key, value = self.store.kv_with_state(self.layer_number, key, value)
            real, prefix = t - meta.num_padding, key.size(0) - t
            cu_q = torch.tensor([0, real, t][: 3 if meta.num_padding else 2], dtype=torch.int32)
            cu_kv = torch.tensor([0, prefix + real, prefix + t][: 3 if meta.num_padding else 2],
                                 dtype=torch.int32)
            if reforward.phase(self.store, meta) is not None:
                return reforward.attention(self.store, self.layer_number, meta, query, key, value,
                                           cu_q, cu_kv, self.softmax_scale,
                                           self.backend).reshape(t, -1)
        else:
            cu_q = cu_kv = torch.tensor(meta.cu_seqlens, dtype=torch.int32)
        # offsets stay on the host: the kernels read them as lists and copy what they need
        out = chunk_attention(query, key, value, cu_q, cu_kv,
                              softmax_scale=self.softmax_scale, backend=self.backend)
        return out.reshape(t, -1)  # [t, np * hn]

    def _forward_cp(self, query, key, value, meta: ChunkMeta):
        """This CP rank's shard of the chunk (runtime/cp.py); with replicated state a dependent
        chunk's K/V are gathered whole before the relay, and attention gathers nothing more.
        Under a hybrid placement the segments this rank holds whole (its first tokens) attend
        here alone, and only the split ones go through the CP attention."""
        t = query.size(0)
        if self.store.cp_keys is None:  # the chunk's first layer on this stage: check once
            import torch.distributed as dist

            size, rank = _cp_size(self.cp_group), dist.get_rank(self.cp_group)
            if (meta.cp_size, meta.cp_rank) != (size, rank):
                raise RuntimeError(f"the chunk was planned for CP rank {meta.cp_rank} of "
                                   f"{meta.cp_size}, but this is rank {rank} of the model's "
                                   f"{size}-rank context-parallel group (plan_step's cp_rank)")
        if not meta.cp_owners:
            return self._split_attention(query, key, value, meta, meta.cu_seqlens).reshape(t, -1)
        local, split = hybrid_cu(meta.cu_seqlens, meta.cp_owners, meta.cp_rank)
        n = local[-1]
        parts = []
        if n:
            cu = torch.tensor(local, dtype=torch.int32)
            parts.append(chunk_attention(query[:n], key[:n], value[:n], cu, cu,
                                         softmax_scale=self.softmax_scale, backend=self.backend))
        if n < t:
            parts.append(self._split_attention(query[n:], key[n:], value[n:], meta, split))
        elif self.store.cp_keys is None:
            self.store.cp_keys = ()  # checked; no split segment, no keys to select
        return torch.cat([p.reshape(p.size(0), -1) for p in parts])  # [t, np * hn]

    def _split_attention(self, query, key, value, meta: ChunkMeta, cu_seqlens):
        """The CP attention of the split segments with boundaries `cu_seqlens` (the whole chunk
        unless placed hybrid): this rank's zigzag pieces of them."""
        replicated = meta.dependent and meta.cp_kv == "replicated"
        if replicated:
            key, value = gather_chunk_kv(key, value, self.cp_group, self.store.cp_traffic)
        if meta.dependent:
            key, value = self.store.kv_with_state(self.layer_number, key, value)
        keys = self.store.cp_keys
        if keys is None:  # the chunk's first layer on this stage: build once
            prefix_chunks = meta.index if meta.dependent else 0
            if not replicated and self._ring(meta, query):
                ring = ring_selection(cu_seqlens, prefix_chunks, meta.chunk_size,
                                      meta.cp_size, meta.cp_rank)
                keys = ring._replace(blocks=tuple(
                    b._replace(keys=_on_device(b.keys, query.device),
                               rows=b.rows.to(query.device)) for b in ring.blocks))
            else:
                keys = _on_device(key_selection(cu_seqlens, prefix_chunks, meta.chunk_size,
                                                meta.cp_size, meta.cp_rank, replicated),
                                  query.device)
            self.store.cp_keys = keys
        kept = reforward.phase(self.store, meta)
        if kept is None:
            return cp_attention(query, key, value, keys, None if replicated else self.cp_group,
                                self.softmax_scale, self.backend, self.store.cp_traffic)
        given = reforward.take(self.store, self.layer_number, query.device) \
            if kept == "use" else None
        sink = [] if kept == "keep" else None
        if sink is not None:
            reforward.check_pair(self.backend, query)
        out = cp_attention(query, key, value, keys, None if replicated else self.cp_group,
                           self.softmax_scale, self.backend, self.store.cp_traffic,
                           kept=given, sink=sink)
        if sink:
            reforward.keep(self.store, self.layer_number, meta, *sink[0])
        return out

    def _ring(self, meta: ChunkMeta, query) -> bool:
        """The ring attention (--chunkflow-cp-attention ring) where the backend has the
        log-sum-exp pair; the others (sdpa, flex, te) gather first."""
        backend = resolve_backend(self.backend, query.device.type, query.dtype)
        return meta.cp_attention == "ring" and lse_pair(backend) is not None


def _on_device(keys: KeySelection, device) -> KeySelection:
    return keys._replace(index=keys.index.to(device))


def _cp_size(group) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)


@contextmanager
def building_core_attention_without_cp(context_parallel_size: int):
    """Build a model that apply_chunkflow will patch, with context parallelism: megatron-core's
    local DotProductAttention refuses CP > 1 when it is built (only Transformer Engine's runs
    CP), and ChunkFlow replaces it before it ever runs, so it is built as if CP were 1."""
    if context_parallel_size == 1:
        yield
        return
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__

    def init(self, config, *args, **kwargs):
        cp, config.context_parallel_size = config.context_parallel_size, 1
        try:
            original(self, config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    DotProductAttention.__init__ = init
    try:
        yield
    finally:
        DotProductAttention.__init__ = original


def _check_config(config) -> None:
    if getattr(config, "apply_rope_fusion", False):
        raise ValueError("ChunkFlow needs RoPE fusion off (--no-rope-fusion / apply_rope_fusion="
                         "False): the fused THD kernel restarts positions at 0 in every segment")
    if getattr(config, "multi_latent_attention", False):
        raise ValueError("multi-latent attention is not supported with ChunkFlow")
    dropout = {"--hidden-dropout": getattr(config, "hidden_dropout", 0.0),
               "--attention-dropout": getattr(config, "attention_dropout", 0.0)}
    if any(dropout.values()):
        raise ValueError(" ".join(f"{flag} {p:g}" for flag, p in dropout.items()) + ": ChunkFlow "
                         "re-forwards chunks, which would draw new dropout masks while later "
                         "chunks keep the first forward's keys and values, so gradients would not "
                         "be exact; give --hidden-dropout 0 --attention-dropout 0 (the released "
                         "checkpoints' setting; Megatron-LM's defaults are 0.1)")


def apply_chunkflow(model, backend: str = "torch", store: KVStateStore | None = None,
                    loss_piece: int = 0, vocab_size: int | None = None) -> KVStateStore:
    """Patch a built GPTModel (or its DDP/Float16 wrapper) in place; returns the K/V state store.
    `loss_piece` > 0: a last stage computes its loss that many tokens at a time
    (runtime/pieced_loss.py; `vocab_size`: the real vocabulary, Megatron's padded rows left out
    of the softmax)."""
    store = store or KVStateStore()
    from megatron.core.transformer.attention import SelfAttention

    gpt = _unwrap(model)
    config = gpt.config
    _check_config(config)
    if getattr(gpt, "position_embedding_type", "rope") != "rope":
        raise ValueError(f"ChunkFlow supports rope position embeddings, not "
                         f"{gpt.position_embedding_type!r}")
    scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
    num_swapped = 0
    for module in gpt.modules():
        if isinstance(module, SelfAttention):
            module.core_attention = ChunkCoreAttention(module.layer_number, scale, store, backend,
                                                       _context_parallel_group(module))
            if _cp_size(module.core_attention.cp_group) > 1:
                # under CP the core attention runs its own backward (runtime/cp.py: from the
                # saved log-sum-exp, or recomputing itself): Megatron's selective core_attn
                # checkpoint would run its gather and forward again
                module.checkpoint_core_attention = False
            num_swapped += 1
    if num_swapped == 0:
        raise ValueError("no SelfAttention modules found: is this a megatron-core GPTModel?")
    _patch_rope(gpt.rotary_pos_emb, store)
    if getattr(config, "num_moe_experts", None):
        from megatron_chunkflow.runtime.moe import apply_moe

        apply_moe(gpt, store)  # the balancing loss per whole sequence
    if loss_piece and gpt.post_process:
        from megatron_chunkflow.runtime.pieced_loss import apply_pieced_loss

        apply_pieced_loss(gpt, loss_piece, vocab_size)
    gpt.chunkflow_state = store
    return store


def _context_parallel_group(attention):
    """The CP group of the attention module's process groups (its pg_collection: the job's, given
    to GPTModel by mcore/build.py)."""
    group = getattr(getattr(attention, "pg_collection", None), "cp", None)
    if group is None:
        raise ValueError(f"{type(attention).__name__} has no context-parallel group: build the "
                         "model on the job's process groups (mcore/build.py build_gpt_model)")
    return group


def _patch_rope(rope, store: KVStateStore) -> None:
    original = rope.forward

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        meta = store.current
        if meta is None:
            return original(max_seq_len, offset, packed_seq, cp_group)
        pos = meta.position_ids  # the whole chunk's (every CP rank's): RoPE picks this rank's
        emb = original(int(pos.max()) + 1, 0, True, cp_group)  # [max_pos + 1, 1, 1, d]
        if not meta.cp_owners:
            return emb[pos.to(emb.device)]  # [t, 1, 1, d]: one row per token
        # hybrid: Megatron's THD RoPE takes the zigzag pieces (rank r and 2 CP - 1 - r) of one
        # segment of every rank's tokens (runtime/inputs.py); this rank's rows go there
        mine = pos[local_index(meta.cu_seqlens, meta.cp_size, meta.cp_rank, meta.cp_owners)]
        half, r = mine.numel() // 2, meta.cp_rank
        whole = emb.new_zeros(meta.num_tokens, *emb.shape[1:])
        whole[r * half:(r + 1) * half] = emb[mine[:half].to(emb.device)]
        end = meta.num_tokens - r * half
        whole[end - half:end] = emb[mine[half:].to(emb.device)]
        return whole

    rope.forward = forward


def _unwrap(model):
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def get_state_store(model) -> KVStateStore:
    store = getattr(_unwrap(model[0] if isinstance(model, list) else model), "chunkflow_state",
                    None)
    if store is None:
        raise ValueError("the model has no ChunkFlow state: call apply_chunkflow(model) first")
    return store
