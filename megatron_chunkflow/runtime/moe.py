"""Mixture of experts under ChunkFlow: the balancing loss of each whole sequence.

    apply_moe(gpt, store)        # by apply_chunkflow, for a model with MoE layers
    store.balance.finish_step()  # by execute_step, after the step's last backward

A token's routing depends on that token alone, so chunking keeps it, and the experts' gradients,
exact. What depends on which tokens share a micro-batch does not carry over, and is settled here:

- `seq_aux_loss` (Megatron's per-sequence balancing loss) is made a loss of each *whole* sequence,
  whatever chunks it is cut into: for sequence s with N_s routed rows (over the router's TP x CP
  group), per expert i its count f_si of routed tokens and its probability sum P_si,
      loss_s = coeff * E / (topk * N_s^2) * sum_i f_si * P_si,
  weighted as Megatron weighs it under per-token loss at the same TP without CP (compat.py
  balancing_loss_scale: N_s / TP before megatron-core 0.19, N_s from 0.19). Chunk c contributes the same expression with its own rows' P (linear in P); the
  counts f_s are the whole sequence's, known only once its last chunk has run forward. A long
  sequence's chunks all run forward before its first backward (the chunk schedule guarantees it),
  so the gradient, which needs f_s only, is formed in backward (_Balance) from counts complete by
  then. Packed short sequences each count alone (their own segment of the chunk). A chunk counts
  once per layer, in the first forward that routes it (with a graph or without: a chunk
  re-forwarded later, or the first pass of Megatron's activation recompute); its re-forward and
  its recompute count nothing again. This is what unchunked Megatron computes with each sequence as its own
  micro-batch, bit for bit in the gradient (Megatron's float32 order of operations is kept).
  Under context parallelism megatron-core before 0.19 shrinks its own weight by CP (a rank's row
  count); ChunkFlow keeps the weight of training without CP.
- The micro-batch (`aux_loss`) and global-batch (`global_aux_loss`) balancing losses, token
  dropping (a capacity factor), the z-loss and the aux-loss-free expert bias are refused by name:
  each depends on how tokens are grouped into micro-batches, or counts re-forwarded tokens twice.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from megatron_chunkflow.runtime.cp_keys import local_index


def check_moe_config(config) -> None:
    """ValueError naming the Megatron flag of each MoE setting ChunkFlow cannot keep exact."""
    types_ = config.moe_router_load_balancing_type
    types_ = [types_] if isinstance(types_, str) else list(types_)
    problems = []
    for kind in ("aux_loss", "global_aux_loss"):
        if kind in types_:
            problems.append(
                f"--moe-router-load-balancing-type {kind}: its expert counts are over a "
                f"{'micro-batch' if kind == 'aux_loss' else 'global batch accumulated micro-batch by micro-batch'}"
                ", which ChunkFlow's chunks regroup, so the loss would not be stock Megatron's; use "
                "seq_aux_loss (per sequence, exact under ChunkFlow) or none")
    if config.moe_expert_capacity_factor is not None:
        problems.append(f"--moe-expert-capacity-factor {config.moe_expert_capacity_factor:g}: "
                        "which tokens are dropped depends on the micro-batch they share; "
                        "ChunkFlow trains dropless MoE (leave the flag out)")
    if config.moe_z_loss_coeff:
        problems.append(f"--moe-z-loss-coeff {config.moe_z_loss_coeff:g}: not supported with "
                        "ChunkFlow yet (a chunk's padding rows would enter it)")
    if getattr(config, "moe_router_enable_expert_bias", False):
        problems.append("--moe-router-enable-expert-bias: its token counts would include every "
                        "re-forwarded chunk twice; not supported with ChunkFlow yet")
    if config.moe_router_load_balancing_type == "sinkhorn":
        problems.append("--moe-router-load-balancing-type sinkhorn: not supported with ChunkFlow")
    if problems:
        raise ValueError("; ".join(problems))


def apply_moe(gpt, store) -> int:
    """Route every TopKRouter of `gpt`'s seq_aux_loss through `store.balance` (a
    SequenceBalance); the number of routers patched (0 for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    if not routers:
        return 0
    check_moe_config(gpt.config)
    if getattr(store, "balance", None) is None:
        store.balance = SequenceBalance()
    for router in routers:
        cls = type(router)
        router._apply_seq_aux_loss = types.MethodType(
            _seq_aux_loss(cls._apply_seq_aux_loss, store), router)
        router.routing = types.MethodType(_routing(cls.routing, store), router)
    return len(routers)


def _seq_aux_loss(original, store):
    """A chunk's forward with a graph: its rows counted (unless already counted), its share of
    the balancing loss attached to the probabilities (Megatron's own outside a ChunkFlow
    chunk)."""
    def apply(router, probs, scores, routing_map, seq_length, bsz, with_padding_mask=False):
        meta = store.current
        coeff = router.get_aux_loss_coeff("seq_aux_loss")
        if meta is None or coeff == 0:
            return original(router, probs, scores, routing_map, seq_length, bsz,
                            with_padding_mask)
        return store.balance.attach(router, meta, probs, scores, routing_map, coeff)
    return apply


def _routing(original, store):
    """A chunk's forward without a graph (the first forward of a chunk re-forwarded later, or
    the first pass of Megatron's activation recompute): Megatron computes no balancing loss then,
    but the chunk's rows count towards its sequence's experts."""
    def routing(router, logits, *args, **kwargs):
        out = original(router, logits, *args, **kwargs)
        meta, coeff = store.current, router.get_aux_loss_coeff("seq_aux_loss")
        if meta is not None and router.training and not torch.is_grad_enabled() and coeff > 0:
            from megatron.core.transformer.moe.moe_utils import (
                compute_routing_scores_for_aux_loss,
            )

            routing_map, scores = compute_routing_scores_for_aux_loss(
                logits.view(-1, router.config.num_moe_experts), router.topk,
                router.score_function, fused=router.config.moe_router_fusion)
            store.balance.count(router, meta, scores, routing_map, coeff)
        return out
    return routing


@dataclass
class _Sequence:
    """One sequence's running totals at one MoE layer, over its chunks' first forwards."""

    counts: torch.Tensor  # [E] routed tokens per expert, summed over the router's TP x CP group
    psum: torch.Tensor  # [E] router probabilities summed over its rows (this rank's), detached
    rows: float = 0.0  # routed rows over the router's TP x CP group


class SequenceBalance:
    """Per (layer, sequence): expert counts and row counts as the sequence's chunks run forward;
    the balancing-loss gradient formed from them in backward; the step's loss values."""

    def __init__(self):
        self._table: dict[tuple, _Sequence] = {}
        self._counted: set[tuple[int, int]] = set()  # (layer, chunk id) counted this step
        self.last: dict[int, float] = {}  # layer number -> the last step's loss / coeff, summed
        #                                    over its sequences (this rank's share, as Megatron's)
        self.last_load: torch.Tensor | None = None  # [E] the last step's routed tokens per
        #                                    expert over this rank's layers, summed over TP x CP
        # layer -> (coeff, experts, topk, TP, layers in the model, the TP x CP group)
        self._layers: dict[int, tuple] = {}

    def count(self, router, meta, scores, routing_map, coeff: float) -> tuple[torch.Tensor, list]:
        """Add a chunk's rows to its sequences' totals at `router`'s layer, once per step: per
        sequence, the routed tokens per expert and the rows, summed over the router's TP x CP
        group, and this rank's probability sums; (this rank's probability sums per sequence of
        the chunk, [len(keys), E], on `scores`' graph; the keys naming those sequences)."""
        segment, keys = _segments(router, meta, scores.shape[0])
        valid = segment >= 0
        idx, num = segment[valid], len(keys)
        psum = scores.new_zeros(num, scores.shape[1]).index_add(0, idx, scores[valid])
        layer = router.layer_number
        if (layer, meta.chunk_id) in self._counted:  # routed again: a re-forward, a recompute
            return psum, keys
        self._counted.add((layer, meta.chunk_id))
        stats = torch.cat([  # float64: whole counts, exact
            scores.new_zeros(num, scores.shape[1], dtype=torch.float64).index_add_(
                0, idx, routing_map[valid].to(torch.float64)),
            torch.bincount(idx, minlength=num).to(torch.float64)[:, None]], dim=1)
        group = router.tp_cp_group
        if group is not None and group.size() > 1:
            torch.distributed.all_reduce(stats, group=group)
        config = router.config
        self._layers[layer] = (coeff, config.num_moe_experts, router.topk,
                               config.tensor_model_parallel_size, config.num_layers, group)
        for s, key in enumerate(keys):
            if stats[s, -1] == 0:  # no row of a sequence here: a filler chunk's padding
                continue           # (core/ep_align.py)
            entry = self._table.get((layer, key))
            if entry is None:
                entry = self._table[(layer, key)] = _Sequence(
                    torch.zeros_like(stats[s, :-1]), torch.zeros_like(psum[s].detach()))
            entry.counts += stats[s, :-1]
            entry.rows += float(stats[s, -1])
            entry.psum += psum[s].detach()
        return psum, keys

    def attach(self, router, meta, probs, scores, routing_map, coeff: float):
        """`probs` carrying the chunk's share of the balancing loss (MoEAuxLossAutoScaler, as
        Megatron attaches its own), its rows counted first if no forward has counted them."""
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        psum, keys = self.count(router, meta, scores, routing_map, coeff)
        aux = _Balance.apply(psum, self, router.layer_number, tuple(keys))
        return MoEAuxLossAutoScaler.apply(probs, aux)

    def gradient(self, layer: int, keys, grad: torch.Tensor) -> torch.Tensor:
        """[len(keys), E]: the gradient of each sequence's weighted loss with respect to its
        probability sums, from its whole counts, in Megatron's order of operations and dtype
        (switch_load_balancing_loss_func's float32 scores, then `aux_loss * num_tokens`), so that a
        row's gradient is bit for bit the one unchunked Megatron gives it."""
        from megatron_chunkflow.compat import balancing_loss_scale

        coeff, experts, topk, tp, _, _ = self._layers[layer]
        rows = []
        for key in keys:
            entry = self._table.get((layer, key))
            if entry is None:  # a filler's padding: no sequence, no loss
                rows.append(grad.new_zeros(experts))
                continue
            total = round(entry.rows)  # Megatron's total_num_tokens (local rows x TP x CP)
            scale = experts * coeff / (topk * total * total)
            # Megatron's weight as it stands without context parallelism: the sequence's rows on
            # a TP rank, its TP group's size (its reference, checks/verify.py, runs without CP)
            weighted = balancing_loss_scale(grad, total // tp, tp)
            rows.append(weighted * scale * entry.counts.round().long())
        return torch.stack(rows)

    def finish_step(self) -> None:
        """The step's balancing loss per layer, this rank's share summed over its sequences and
        divided by the coefficient, into `last` and into Megatron's MoE tracker (as its router
        records it: Megatron-LM's logging and `verify` read it there); then forget the step."""
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        last: dict[int, float] = {}
        for (layer, _), entry in self._table.items():
            _, experts, topk, _, _, _ = self._layers[layer]
            n = entry.rows
            value = float((entry.counts * entry.psum.double()).sum()) * experts / (topk * n * n)
            last[layer] = last.get(layer, 0.0) + value
        for layer, value in sorted(last.items()):
            *_, num_layers, group = self._layers[layer]
            save_to_aux_losses_tracker("seq_load_balancing_loss", torch.tensor(value), layer,
                                       num_layers, reduce_group=group)
        load = None
        for entry in self._table.values():
            load = entry.counts.clone() if load is None else load + entry.counts
        self.last, self.last_load = last, load
        self.clear()

    def clear(self) -> None:
        self._table.clear()
        self._counted.clear()


class _Balance(torch.autograd.Function):
    """The balancing loss's share of one chunk: its value is left at 0 (the step's values are
    SequenceBalance.last); its gradient, the scale MoEAuxLossAutoScaler hands it times each
    sequence's weights, reads the whole sequence's counts in backward, when they are complete."""

    @staticmethod
    def forward(ctx, psum, balance, layer, keys):
        ctx.balance, ctx.layer, ctx.keys = balance, layer, keys
        return psum.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return ctx.balance.gradient(ctx.layer, ctx.keys, grad), None, None, None


def _segments(router, meta, rows: int) -> tuple[torch.Tensor, list]:
    """Per row the router sees: the index of its sequence among `keys` (-1: padding), and keys
    naming each sequence of the chunk: a long sequence by its id, a packed one by its chunk and
    segment."""
    cu = meta.cu_seqlens
    real = len(meta.segment_padding)
    if meta.cp_size > 1:
        positions = local_index(cu, meta.cp_size, meta.cp_rank, meta.cp_owners)
    else:
        positions = torch.arange(cu[-1])
    config = router.config
    if config.sequence_parallel and config.tensor_model_parallel_size > 1:
        tp, rank = config.tensor_model_parallel_size, router.tp_group.rank()
        share = positions.numel() // tp
        positions = positions[rank * share:(rank + 1) * share]
    if positions.numel() != rows:
        raise RuntimeError(f"the router sees {rows} rows, the chunk's layout says "
                           f"{positions.numel()}")
    bounds = torch.tensor(cu[1:], dtype=torch.long)
    segment = torch.searchsorted(bounds, positions, right=True)
    ends = torch.tensor([cu[s + 1] - pad for s, pad in enumerate(meta.segment_padding)] + [0],
                        dtype=torch.long)  # where each segment's own tokens end
    segment[(segment >= real) | (positions >= ends[segment.clamp(max=real)])] = -1
    if meta.dependent:
        keys = [("sequence", meta.seq_id)]
    else:
        keys = [("packed", meta.chunk_id, s) for s in range(real)]
    return segment.to(router.weight.device), keys


def take_tracked_loss() -> float:
    """This rank's share of the step's seq_load_balancing_loss in Megatron's MoE tracker (summed
    over layers, divided by the coefficient; 0 where nothing was recorded), the tracker then
    cleared for the next step."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    entry = get_moe_layer_wise_logging_tracker().get("seq_load_balancing_loss")
    value = float(entry["values"].detach().double().sum()) if entry is not None else 0.0
    clear_aux_losses_tracker()
    return value


def step_metrics(store, config, num_sequences: int, tp_cp: int) -> dict:
    """A training step's MoE records, on every rank (collectives over the world): the balancing
    loss as Megatron-LM logs it (Megatron's tracker, over ranks, per MoE layer and sequence,
    divided by the coefficient) and, for ChunkFlow's steps, each expert's share of the routed
    tokens over every layer (`tp_cp`: the ranks that hold the same counts). Megatron's tracker
    is cleared for the next step."""
    import torch.distributed as dist

    from megatron_chunkflow.runtime.p2p import comm_device

    balance = store.balance
    load = balance.last_load if balance is not None else None
    totals = torch.zeros(2 + config.num_moe_experts, dtype=torch.float64, device=comm_device())
    totals[0] = take_tracked_loss()
    if load is not None:
        totals[1] = 1.0
        totals[2:] = load.to(totals.device) / tp_cp
        balance.last_load = None
    if dist.is_initialized():
        dist.all_reduce(totals)
    out = {"balancing_loss": float(totals[0]) / (config.num_layers * max(num_sequences, 1))}
    if totals[1] > 0 and totals[2:].sum() > 0:
        share = totals[2:] / totals[2:].sum()
        out["expert_load"] = [round(float(x), 4) for x in share]
    return out
