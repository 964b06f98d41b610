"""The audit of megatron-core's model settings: every field of ``TransformerConfig`` and ``MLATransformerConfig``
(0.16.1 and 0.19.2) and every argument of ``GPTModel`` / ``MambaModel`` is exactly one of

- read into a field of ``ModelConfig`` or of a feature record (its ``config`` names, ``config.read_names``);
- covered by another setting that is read (``COVERED``: meaningful only together with it);
- refused on read (``UNCONVERTED``: a stored layout or a structure dist_convert does not convert);
- known not to change the forward pass (``NOT_MATH``, by reason).

``ModelParallelConfig``'s fields (parallel sizes, communication overlap, the params dtype) are the target layout's
and the cast's, never the model's function. ``tests/test_features.py`` checks the audit against the megatron-core it
runs under, so a setting a new release adds fails the suite until it is placed here.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConvertError

PARALLEL = "parallelism and pipeline placement (the target layout's)"
TRAINING = "training only: dropout, losses, load balancing, recomputation, offloading, initialisation"
KERNEL = "kernels, fusions and graphs computing the same function"
PRECISION = "precision: the same function in another dtype or rounding"
INFERENCE = "inference serving and logging"
STRUCTURE = "how the model is built (specs, stages, process groups), not a setting of it"


def _names(reason: str, text: str) -> dict[str, str]:
    return dict.fromkeys(text.split(), reason)


NOT_MATH: dict[str, str] = {
    **_names(PARALLEL, """account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split cp_comm_type
        num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage pipeline_model_parallel_layout
        moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms
        moe_deepep_num_sms moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing moe_hybridep_num_blocks_permute
        moe_hybridep_num_blocks_unpermute moe_hybridep_pad_uneven_dispatch_inputs moe_permute_fusion_into_hybridep
        moe_ncclep_static_shape moe_ncclep_zero_copy high_priority_a2a_comm_stream symmetric_ar_type
        nccl_all_reduce_for_prefill delta_offload_bytes_across_pp_ranks parallel_output
        scatter_embedding_sequence_parallel pg_collection vp_stage pre_process post_process"""),
    **_names(TRAINING, """hidden_dropout attention_dropout mtp_loss_scaling_factor mtp_detach_heads init_method
        output_layer_init_method init_method_std embedding_init_method embedding_init_method_std
        init_model_with_meta_device recompute_granularity recompute_method recompute_num_layers recompute_modules
        distribute_saved_activations moe_layer_recompute moe_router_load_balancing_type moe_aux_loss_coeff
        moe_z_loss_coeff moe_input_jitter_eps moe_router_bias_update_rate moe_router_quantile_balancing_ema
        moe_enable_routing_replay moe_per_layer_logging calculate_per_token_loss qk_clip qk_clip_alpha
        qk_clip_threshold log_max_attention_logit fine_grained_activation_offloading offload_modules
        min_offloaded_tensor_size fine_grained_offloading_max_inflight_offloads activation_offload_fraction
        delay_offload_until_cuda_graph moe_paged_stash moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cpu
        moe_paged_stash_buffer_size_factor_cuda mlp_chunks_for_training experimental_attention_variant_loss_scale_func
        fp16_lm_cross_entropy dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss"""),
    **_names(KERNEL, """attention_backend bias_activation_fusion masked_softmax_fusion persist_layer_norm
        memory_efficient_layer_norm bias_dropout_fusion apply_rope_fusion use_fused_weighted_squared_relu
        fused_single_qkv_rope fused_residual_rmsnorm moe_permute_fusion moe_router_fusion moe_grouped_gemm
        moe_use_legacy_grouped_gemm moe_shared_expert_overlap use_te_activation_func use_kitchen use_kitchen_attention
        kitchen_attention_backend use_transformer_engine_op_fuser flash_decode flash_attention_version
        use_mamba_mem_eff_path enable_cuda_graph cuda_graph_use_single_mempool cuda_graph_retain_backward_graph
        cuda_graph_warmup_steps external_cuda_graph cuda_graph_impl cuda_graph_scope cuda_graph_modules
        clone_scatter_output_in_embedding disable_parameter_transpose_cache mlp_chunks_for_prefill
        dsa_kernel_backend cache_mla_latents"""),
    **_names(PRECISION, """fp32_residual_connection apply_query_key_layer_scaling attention_softmax_in_fp32
        disable_bf16_reduced_precision_matmul activation_func_fp8_input_store fp8 fp8_recipe fp8_param
        fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len fp8_amax_compute_algo fp8_wgrad
        fp8_dot_product_attention fp8_multi_head_attention fp8_output_proj tp_only_amax_red first_last_layers_bf16
        num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 fp4 fp4_recipe fp4_param fp4_quantizer_factory
        quant_recipe batch_invariant_mode moe_router_padding_for_quantization moe_router_padding_for_fp8
        mamba_training_ssm_states_dtype"""),
    **_names(INFERENCE, """inference_rng_tracker inference_sampling_seed use_inference_optimized_layers
        inference_fuse_tp_communication inference_cuda_graph_scope inference_disable_triton_nvls_kernels
        inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels inference_moe_token_dispatcher_type
        moe_pad_experts_for_cuda_graph_inference config_logger_dir test_mode"""),
    **_names(STRUCTURE, "self config transformer_layer_spec mtp_block_spec mamba_stack_spec args kwargs"),
}

# settings meaningful only together with one that is read (then refused or carried with it)
COVERED: dict[str, str] = {
    **dict.fromkeys(("moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_token_dropping"),
                    "moe_expert_capacity_factor"),
    **dict.fromkeys(("mup_attn_scale_power", "mup_base_head_dim", "mup_base_hidden_size", "mup_embedding_mult",
                     "mup_output_mult", "mup_width_mult"), "use_mup"),
    # megatron-core <= 0.18's one depth of a HybridModel's MTP pattern: read into Mamba.mtp_pattern
    "mtp_hybrid_override_pattern": "hybrid_override_pattern",
}

# Megatron-LM args name -> (its value that changes nothing, why a checkpoint with another value is refused on read)
UNCONVERTED: dict[str, tuple[Any, str]] = {
    "heterogeneous_layers_config_path": (None, "heterogeneous layers (each layer its own sizes)"),
    "heterogeneous_layers_config_encoded_json": (None, "heterogeneous layers (each layer its own sizes)"),
    "heterogeneous_block_specs": (False, "heterogeneous layers (each layer its own sizes)"),
    "hetereogenous_dist_checkpoint": (False, "heterogeneous layers (each layer its own sizes)"),
    "moe_latent_size": (None, "latent MoE projections"),
    "mla_down_proj_fusion": (False, "MLA's fused q/kv down-projection"),
    "mtp_use_repeated_layer": (False, "one multi-token-prediction layer repeated"),
    "moe_mlp_glu_interleave_size": (None, "block-interleaved expert GLU weights"),
    "moe_shared_expert_glu_interleave_size": (None, "block-interleaved shared-expert GLU weights"),
    "moe_single_grouped_weight": (False, "all experts in one grouped parameter"),
    "moe_single_grouped_bias": (False, "all experts' biases in one grouped parameter"),
    "use_grouped_gemm_for_dense_mlp": (False, "dense MLPs stored as grouped linears"),
    "use_grouped_gemm_for_shared_expert": (False, "shared experts stored as grouped linears"),
    "hybrid_attention_ratio": (0.0, "a hybrid stack given by ratios instead of hybrid_override_pattern"),
    "hybrid_mlp_ratio": (0.0, "a hybrid stack given by ratios instead of hybrid_override_pattern"),
}


def refuse_unconverted(args: argparse.Namespace) -> None:
    """Refuse, in one line, args that set a layout or structure dist_convert does not convert."""
    for name, (plain, what) in UNCONVERTED.items():
        value = getattr(args, name, None)
        if value is not None and value != plain and not (value is False and plain is None):
            raise ConvertError(f"the checkpoint args set {name}={value!r} ({what}), which dist_convert does not "
                               "convert", f"convert a checkpoint without {name} (megatron-core's default: {plain!r})")
