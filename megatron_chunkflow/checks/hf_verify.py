"""ChunkFlow on megatron-core against transformers' own model class for one HF checkpoint
(Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM,
Qwen2MoeForCausalLM, MixtralForCausalLM: AutoModelForCausalLM).

    chunkflow verify --hf-reference DIR        # float64, the default batch

The reference is independent of Megatron: transformers loads DIR and runs every sequence whole
(its RMSNorm formula run in float64: transformers computes it in float32 whatever the model dtype;
and the gradient scaled by the float32 1/num_tokens that Megatron's finalize_model_grads applies)
(attention through torch SDPA, which keeps float64: the eager path runs its softmax in float32); the loss is the per-token cross entropy over the SFT loss mask, divided by
the batch's token count, and its gradients are read off the HF parameters. The chunked side imports
DIR into a megatron-core GPTModel (padded vocabulary, this rank's TP/PP slice), runs ChunkFlow's plan,
and maps its gradients back to HF names (export_hf_weights applied to the gradients; padding rows
dropped). transformers is a test extra, not a runtime requirement.

Mixture of experts: both libraries round the router's softmax to float32 whatever the model dtype,
transformers over all experts then renormalising the top k, megatron-core over the top k logits
(equal in exact arithmetic, not in float32); the reference's routers compute it as megatron-core
does (_routers_as_megatron), the way its RMSNorms run in the model dtype. The loss compared is the
language-model loss: transformers adds no router loss unless asked, so the chunked model is built
without the balancing loss here (its exactness is checked against unchunked megatron-core, which
computes the same per-sequence loss: checks/verify.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megatron_chunkflow.checks.verify import VerifyResult
from megatron_chunkflow.config import ChunkFlowConfig, ParallelConfig
from megatron_chunkflow.data.synthetic import make_sequences


def hf_reference(hf_dir: str, sequences, dtype=torch.float64, shape=None):
    """(loss, {hf name: gradient}) of transformers' unchunked model on `sequences`; with an MoE
    `shape` (its ModelShape), the gradients in the checkpoints' layout (one per expert)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError("--hf-reference needs transformers: pip install -e \".[hf]\" (or pip "
                         "install transformers)") from None
    # cast after loading: exact (checkpoints hold fewer bits), and the same in every transformers
    # (the keyword is torch_dtype before 4.56, dtype after)
    # MoE (transformers 5): the experts one by one, whose float64 matmuls are exact where the
    # default grouped GEMM takes no float64
    moe = shape is not None and shape.is_moe
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="sdpa",
        **({"experts_implementation": "eager"} if moe else {})).to(dtype)
    model.train()
    if dtype == torch.float64:
        _norms_in_float64(model)
    if moe:
        _routers_as_megatron(model, shape.moe_norm_topk)
    total_tokens = sum(float(s.loss_mask.sum()) for s in sequences)
    # Megatron's finalize_model_grads scales gradients by `1.0 / num_tokens` with num_tokens an
    # int tensor, i.e. by a float32 number, after the backward of the summed loss; apply the same
    # scale at the same point, so that only computation differs (where a float32 step is in the
    # backward, as the MoE router's softmax, scaling before it would round differently)
    scale = (1.0 / torch.tensor(int(total_tokens), dtype=torch.int)).item() if total_tokens else 0.0
    loss_sum = 0.0
    for s in sequences:
        logits = model(s.tokens.view(1, -1)).logits[0]  # [L, V]
        labels = torch.cat([s.tokens[1:], s.tokens.new_zeros(1)])
        losses = F.cross_entropy(logits.to(dtype), labels, reduction="none")
        loss = (losses * s.loss_mask.to(dtype)).sum()
        loss.backward()
        loss_sum += float(loss.detach())
    grads = {n: p.grad.detach() * scale for n, p in model.named_parameters()
             if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    if moe:
        from megatron_chunkflow.mcore.hf_moe import checkpoint_layout

        grads = checkpoint_layout(grads, shape.family)
    return loss_sum / max(total_tokens, 1.0), grads


def _routers_as_megatron(model, norm_topk: bool) -> None:
    """Each top-k router of an MoE model (transformers 5: the modules named *TopKRouter, returning
    logits, the top-k probabilities and their experts) computes its probabilities as megatron-core's
    router does (moe_utils.topk_routing_with_score_function): the softmax in float32, over the top-k
    logits where the top k are renormalised, else over all logits before the top k."""
    import types

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers or not all(hasattr(m, "top_k") and hasattr(m, "weight") for m in routers):
        raise RuntimeError(f"{type(model).__name__}: its routers are not the ones this check knows "
                           "(transformers 5's *TopKRouter with top_k and weight)")

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.weight.shape[1]), self.weight)
        if norm_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, experts = torch.topk(scores, self.top_k, dim=-1)
        return logits, probs, experts

    for module in routers:
        module.forward = types.MethodType(forward, module)


def _rms_norm_same_dtype(self, hidden_states):
    """transformers' RMSNorm.forward formula (Qwen2, Qwen3, Llama, Mistral alike) without its
    cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _norms_in_float64(model) -> None:
    """transformers' RMSNorms (the layer norms and Qwen3's QK norms) compute in float32 whatever
    the model dtype, which caps any float64 comparison at ~1e-7; run the same formula in the
    model's dtype. (RoPE frequencies, Llama 3's scaling included, are float32 in both libraries,
    computed the same way.)"""
    import types

    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    if not norms or not all(hasattr(m, "variance_epsilon") for m in norms):
        raise RuntimeError(f"{type(model).__name__}: its RMSNorm modules are not the ones this "
                           "check knows (a weight and variance_epsilon)")
    for module in norms:
        module.forward = types.MethodType(_rms_norm_same_dtype, module)


HF_REFERENCES: dict[tuple, tuple] = {}  # run_hf_verify's transformers runs, by what they depend on


def _checkpoint_signature(hf_dir: str) -> tuple:
    """The checkpoint directory and each file's name, size and modification time: a rewritten
    checkpoint is another reference."""
    from pathlib import Path

    root = Path(hf_dir).resolve()
    return str(root), tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                   for p in root.iterdir() if p.is_file()))


def run_hf_verify(hf_dir: str, lengths: Sequence[int], chunkflow: ChunkFlowConfig,
                  parallel: ParallelConfig = ParallelConfig(), seed: int = 0,
                  model_class: str = "gpt") -> VerifyResult:
    """One step of ChunkFlow (megatron-core's `model_class`, float64) against transformers on the
    same batch. The
    transformers run of one (checkpoint, lengths, seed) is computed once per process
    (HF_REFERENCES): a long-lived job checking many layouts runs it once."""
    from megatron_chunkflow.mcore.build import build_chunkflow_model
    from megatron_chunkflow.mcore.dist import init_distributed
    from megatron_chunkflow.mcore.hf import export_hf_weights, padded_vocab_size, shape_from_hf_dir
    from megatron_chunkflow.mcore.step import forward_backward
    from megatron_chunkflow.runtime.execute import plan_step
    from megatron_chunkflow.runtime.loss import global_loss, make_forward_step

    dtype = torch.float64
    shape = shape_from_hf_dir(hf_dir)
    sequences = make_sequences(lengths, shape.vocab_size, seed)
    key = (_checkpoint_signature(hf_dir), tuple(lengths), seed, dtype)
    if key not in HF_REFERENCES:
        HF_REFERENCES[key] = hf_reference(hf_dir, sequences, dtype, shape)
    ref_loss, ref_grads = HF_REFERENCES[key]

    job = init_distributed(parallel, seed)
    # the language-model loss, as transformers computes it (no router loss: module docstring)
    padded = dataclasses.replace(shape, vocab_size=padded_vocab_size(shape.vocab_size,
                                                                     parallel.tp),
                                 moe_aux_loss_coeff=None)
    cm = build_chunkflow_model(padded, dtype, job, load_hf=hf_dir, hf_shape=shape,
                               attention_backend=chunkflow.attention_backend,
                               model_class=model_class)
    step = plan_step(sequences, chunkflow, job.parallel, padded, job.ranks)
    reports = forward_backward(job, cm, step, make_forward_step(
        job.groups.tp, exact_loss=True, vocab_size=shape.vocab_size))
    loss, count = global_loss(reports, job.ranks.tp)

    params = [p for model in cm.models for p in model.parameters()]
    saved = [p.data for p in params]
    try:  # the gradients have the parameters' layout: export them as if they were weights
        for p in params:
            p.data = p.main_grad.to(p.dtype)
        grads = export_hf_weights(cm.models, cm.config, shape)
    finally:
        for p, data in zip(params, saved):
            p.data = data
    errors = []
    for name in sorted(ref_grads):
        g_ref, g = ref_grads[name].double(), grads[name].double()
        scale = g_ref.abs().max().item()
        diff = (g - g_ref).abs().max().item()
        errors.append((name, diff / scale if scale > 0 else diff))
    worst = max(errors, key=lambda e: e[1])
    return VerifyResult(loss_ref=ref_loss, loss_chunked=loss / max(count, 1.0),
                        max_rel_grad_err=worst[1], worst_param=worst[0], param_errors=errors,
                        num_chunks=len(step.metas))
