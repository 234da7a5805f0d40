"""Build a megatron-core GPTModel from a core.models.ModelShape (Qwen2/2.5, Qwen3, Llama 3.x,
Mistral), and the one ChunkFlow model every entry point trains (`build_chunkflow_model`).

    job = init_distributed(ParallelConfig(pp=2))         # mcore/dist.py; mcore/job.py
    cm = build_chunkflow_model(shape, torch.float64, job)
    forward_backward(job, cm, step, make_forward_step(job.groups.tp))   # mcore/step.py

Every family: GQA (num_query_groups), RMSNorm, SwiGLU MLP, RoPE, tied or untied embeddings; the
shape's switches add Qwen2's bias on QKV, Qwen3's QK norm (qk_layernorm) and head dim
(kv_channels), Llama 3's RoPE scaling (GPTModel's rope_scaling / rope_scaling_factor). The local
layer spec on CPU; Transformer Engine's when it is installed and CUDA is present. Fusions that need CUDA kernels are off on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_chunkflow import compat
from megatron_chunkflow.core.models import ModelShape
from megatron_chunkflow.mcore.job import Job
from megatron_chunkflow.mcore.names import full_model_name


def transformer_config(shape: ModelShape, job: Job, dtype: torch.dtype = torch.float32,
                       device: str | None = None, fusions: bool = True, **overrides):
    """Megatron's TransformerConfig of `shape` for a run of `job`'s layout (its degrees; its
    sequence parallelism and recompute are the caller's overrides) on `device` ("cuda", "cpu";
    None: this machine's). On a GPU with `fusions`, Megatron-LM's default fused kernels that need
    neither Transformer Engine nor Apex: bias-SwiGLU (saves fc1's output only, SiLU and the
    product are recomputed in its backward) and bias-dropout-add; RoPE fusion stays off
    (ChunkFlow's positions continue across chunks)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel = job.parallel
    on_gpu = torch.cuda.is_available() if device is None else device == "cuda"
    fused = on_gpu and fusions
    kw = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.vpp > 1 else None,
        context_parallel_size=parallel.cp,
        use_cpu_initialization=not on_gpu,
        apply_rope_fusion=False,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,  # torch.compile'd: GPU only
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
    )
    if shape.is_moe:
        kw.update(moe_kwargs(shape, parallel))
    kw.update(overrides)
    return TransformerConfig(**kw)


def moe_kwargs(shape: ModelShape, parallel) -> dict:
    """TransformerConfig's mixture-of-experts fields for `shape`: megatron-core's MoE layer in every
    layer (router, dropless all-to-all token dispatch, SequentialMLP experts), the balancing loss
    per sequence (`seq_aux_loss`, the one ChunkFlow keeps exact: runtime/moe.py)."""
    coeff = shape.moe_aux_loss_coeff or 0.0
    kw = dict(num_moe_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
              moe_router_topk=shape.moe_topk, moe_router_pre_softmax=not shape.moe_norm_topk,
              moe_router_load_balancing_type="seq_aux_loss" if coeff else "none",
              moe_aux_loss_coeff=coeff, moe_token_dispatcher_type="alltoall",
              moe_grouped_gemm=False, expert_model_parallel_size=parallel.ep,
              expert_tensor_parallel_size=parallel.expert_tp)
    if shape.moe_shared_expert_size:
        kw.update(moe_shared_expert_intermediate_size=shape.moe_shared_expert_size,
                  moe_shared_expert_gate=True)
    return kw


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm as a megatron norm module that also works under sequence parallelism.

    megatron-core's WrappedTorchNorm (the local spec without apex) refuses sequence_parallel; this
    one tags its weight so finalize_model_grads all-reduces its gradient over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def local_layer_spec(config, vp_stage: int | None = None):
    """The local GPT layer spec (with QK norms where config.qk_layernorm); with sequence
    parallelism, every norm is a TorchRMSNorm (model chunk `vp_stage`'s layers)."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm",
                                    qk_layernorm=config.qk_layernorm)
    if not config.sequence_parallel:
        return spec
    attention = spec.submodules.self_attention
    if config.qk_layernorm:  # per head, on each TP rank's heads; gradients summed over TP
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=TorchRMSNorm, k_layernorm=TorchRMSNorm))
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=TorchRMSNorm, pre_mlp_layernorm=TorchRMSNorm,
        self_attention=attention))
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=TorchRMSNorm)


def build_gpt_model(shape: ModelShape, config, job: Job, max_seq_length: int = 1 << 20,
                    vp_stage: int | None = None, device: str | None = None):
    """A GPTModel for this rank's pipeline stage of `job` (model chunk `vp_stage` of it with
    virtual stages) on the job's process groups, on `device` (None: this machine's), cast to
    config.params_dtype (norms included)."""
    return build_model(shape, config, job, "gpt", max_seq_length, vp_stage, device)


def build_model(shape: ModelShape, config, job: Job, model_class: str = "gpt",
                max_seq_length: int = 1 << 20, vp_stage: int | None = None,
                device: str | None = None):
    """This rank's stage of `shape` as `model_class` ("gpt": GPTModel; "hybrid": HybridModel,
    mcore/hybrid.py, built from the GPT `config` with its layers split in two), on `device`, cast
    to config.params_dtype."""
    from megatron_chunkflow.mcore.cpu import (
        fix_checkpoint_without_output,
        fix_dispatcher_splits_on_cpu,
        fix_router_gemm_without_te,
    )
    from megatron_chunkflow.runtime.model import building_core_attention_without_cp

    fix_checkpoint_without_output()  # selective layernorm recompute without Transformer Engine
    if config.num_moe_experts:
        fix_router_gemm_without_te()
        fix_dispatcher_splits_on_cpu()
        # Megatron's MoE logging tracker is one per process, each loss sized by the layers of the
        # first model that logged it: a model built after another (verify's reference and
        # layouts, a notebook) starts it empty
        compat.reset_moe_metrics()
    # under CP, ChunkFlow's attention replaces the local one, which refuses CP when it is built
    with building_core_attention_without_cp(config.context_parallel_size):
        if model_class == "hybrid":
            from megatron_chunkflow.mcore.hybrid import build_hybrid_model, hybrid_config

            model = build_hybrid_model(shape, hybrid_config(config), job, max_seq_length,
                                       vp_stage)
        else:
            model = _gpt_model(shape, config, job, max_seq_length, vp_stage)
    return _placed(model, config, device)


def _gpt_model(shape: ModelShape, config, job: Job, max_seq_length: int, vp_stage):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=local_layer_spec(config, vp_stage),
        vocab_size=shape.vocab_size,
        max_sequence_length=max_seq_length,
        pre_process=job.is_first_stage(vp_stage),
        post_process=job.is_last_stage(vp_stage),
        share_embeddings_and_output_weights=shape.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rotary_base),
        rope_scaling=shape.rope_scaling_factor is not None,
        rope_scaling_factor=shape.rope_scaling_factor or 8.0,
        vp_stage=vp_stage,
        pg_collection=job.groups,
    )


def _placed(model, config, device):
    """megatron-core builds linears and embeddings on the GPU but the local spec's norms on the
    CPU; Megatron-LM's get_model moves the whole model, as this does."""
    from megatron_chunkflow.mcore.cpu import has_real_cuda

    if device == "cuda" if device is not None else has_real_cuda():
        model = model.cuda(torch.cuda.current_device())
    return model.to(dtype=config.params_dtype)


def wrap_ddp(models, config, distributed_optimizer: bool = False):
    """Megatron's DDP wrapper (grad buffers, no_sync) around each model chunk, wired as
    Megatron-LM's train() wires it (bucketing only in the first chunk, no_sync of every chunk),
    its buffers laid out for Megatron's distributed optimizer if `distributed_optimizer`; a list
    for a list, one for one."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    chunks = models if isinstance(models, list) else [models]
    ddps = [DistributedDataParallel(
        # bf16 gradients accumulate in fp32 across micro-batches and chunks (Megatron-LM forces
        # the same for bf16)
        config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=config.bf16, use_distributed_optimizer=distributed_optimizer),
        model, disable_bucketing=v > 0) for v, model in enumerate(chunks)]
    config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    config.finalize_model_grads_func = finalize_model_grads
    return ddps if isinstance(models, list) else ddps[0]


@dataclass
class ChunkFlowModel:
    """This rank's pipeline stage of a GPTModel patched for chunk attention (runtime/model.py),
    its K/V state store and Megatron's DDP around it; with virtual stages its V model chunks
    (`models`, `ddps`: Megatron's list of model chunks), one store for all."""

    models: list  # the GPTModel stage per model chunk (parameters named as Megatron names them)
    ddps: list  # megatron.core.distributed.DistributedDataParallel per model chunk
    store: object  # runtime/state.py KVStateStore

    @property
    def model(self):
        """The GPTModel stage (without virtual stages)."""
        return self._only(self.models)

    @property
    def ddp(self):
        """What execute_step and Megatron's schedules take: the DDP module, or the list of model
        chunks with virtual stages."""
        return self.ddps[0] if len(self.ddps) == 1 else self.ddps

    @property
    def config(self):
        return self.models[0].config

    def zero_grad_buffers(self) -> None:
        """Every model chunk's DDP gradient buffer zeroed (before a step's forward-backward)."""
        for ddp in self.ddps:
            ddp.zero_grad_buffer()

    def named_parameters(self):
        """(PP = 1 model's name, parameter) over every model chunk of this rank."""
        for model in self.models:
            for name, param in model.named_parameters():
                yield full_model_name(name, model), param

    @staticmethod
    def _only(items):
        if len(items) != 1:
            raise ValueError("this rank holds several model chunks (virtual pipeline stages): "
                             "use .models")
        return items[0]


def build_chunkflow_model(shape: ModelShape, dtype: torch.dtype, job: Job, *,
                          attention_backend: str = "auto", load_hf: str | None = None,
                          hf_shape: ModelShape | None = None, lora=None, lora_seed: int = 0,
                          lora_b_init_std: float = 0.0, weights: dict | None = None,
                          device: str | None = None, fusions: bool = True,
                          loss_piece: int = 0, vocab_size: int | None = None,
                          distributed_optimizer: bool = False,
                          model_class: str = "gpt") -> ChunkFlowModel:
    """The ChunkFlow model of `chunkflow train`, verify, bench and the memory check, built in one
    order on `job`'s process groups (mcore/dist.py: init_distributed):

    1. this stage's `model_class` (build_model: "gpt" or "hybrid") in `dtype`, with the job's
       sequence parallelism and recompute;
    2. `load_hf`: a Hugging Face checkpoint directory's weights (`hf_shape`: its unpadded shape);
    3. `lora` (mcore/lora.py LoRAConfig): adapters seeded by `lora_seed` (B drawn from
       N(0, lora_b_init_std) for gradient checks), every other weight frozen;
    4. `weights`: a state dict by the PP = 1 model's names (verify's reference weights, adapters
       included), this stage's slice loaded;
    5. chunk attention (`attention_backend`, runtime/model.py: apply_chunkflow), Megatron's DDP.
    `device`, `fusions`: where it trains (None: this machine) and transformer_config's fusions;
    `loss_piece`, `vocab_size`: the last stage's loss in token pieces (runtime/pieced_loss.py);
    `distributed_optimizer`: DDP's buffers laid out for Megatron's distributed optimizer."""
    from megatron_chunkflow.runtime.model import apply_chunkflow

    parallel = job.parallel
    config = transformer_config(shape, job, dtype, device, fusions,
                                sequence_parallel=parallel.sequence_parallel,
                                **parallel.recompute.megatron_kwargs())
    stages = [None] if parallel.vpp == 1 else list(range(parallel.vpp))
    models, store = [], None
    for vp_stage in stages:
        model = build_model(shape, config, job, model_class, vp_stage=vp_stage, device=device)
        if load_hf:
            from megatron_chunkflow.mcore.hf import import_hf_weights

            import_hf_weights(model, load_hf, config, hf_shape or shape)
        if lora is not None:
            from megatron_chunkflow.mcore.lora import apply_lora

            apply_lora(model, lora, lora_seed, b_init_std=lora_b_init_std)
        if weights is not None:
            names = {n: full_model_name(n, model) for n in model.state_dict()}
            model.load_state_dict({n: weights[names[n]] for n in names})
        store = apply_chunkflow(model, backend=attention_backend, store=store,
                                loss_piece=loss_piece, vocab_size=vocab_size)
        models.append(model)
    return ChunkFlowModel(models, wrap_ddp(models, config, distributed_optimizer), store)
