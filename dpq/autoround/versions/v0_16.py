"""auto-round 0.16 (checked on 0.16.1): what dpq expects of it (the fields: :mod:`dpq.autoround.versions`)."""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["CALLED", "LOOP_REPRODUCED", "NOT_PATCHED", "RELEASE", "REPRODUCED", "SIGNATURES"]

RELEASE = "0.16.1"

_SR = "auto_round.algorithms.quantization.sign_round.quantizer"
_RTN = "auto_round.algorithms.quantization.rtn.quantizer"
_V2 = "auto_round.algorithms.quantization.sign_roundv2.quantizer"
_AWQ = "auto_round.algorithms.transforms.awq.base:AWQTransform"
_BASE = "auto_round.compressors.base:BaseCompressor"
_BLOCK_PARAMS = "self, block, fp_inputs, input_others, fp_outputs, q_inputs, block_ctx, input_ids=None, **kwargs"

SIGNATURES: MappingProxyType[str, str] = MappingProxyType({
    f"{_SR}:SignRoundQuantizer.quantize_block": _BLOCK_PARAMS,
    f"{_SR}:SignRoundQuantizer.dispatch_block": "self, block, input_ids, input_others",
    "auto_round.algorithms.composer:AlgorithmComposer.compress_block":
        "self, block, fp_inputs, input_others, block_ctx, q_inputs=None, input_ids=None, reference_output=None, "
        "**kwargs",
    f"{_BASE}.quantize_and_save":
        "self, output_dir='tmp_autoround', format=None, inplace=True, max_shard_size=None, **kwargs",
    f"{_BASE}.save_quantized":
        "self, output_dir=None, format=None, inplace=True, return_folders=False, max_shard_size=None, **kwargs",
    "auto_round.compressors.mllm_mixin:MLLMMixin.save_quantized":
        "self, output_dir=None, format='auto_round', inplace=True, **kwargs",
    "auto_round.compressors.diffusion_mixin:DiffusionMixin.save_quantized":
        "self, output_dir=None, format=None, inplace=True, return_folders=False, **kwargs",
    f"{_BASE}._adjust_immediate_packing_and_saving": "self",
    f"{_SR}:setup_ddp_if_needed_": "ar, block, device_list",
    f"{_RTN}:RTNQuantizer.quantize_block": _BLOCK_PARAMS,
    f"{_RTN}:OptimizedRTNQuantizer._quantize_targets": "self, targets",
    f"{_V2}:SignRoundOptimizedWrapperLinear._prepare_init_scale_weight": "self",
    f"{_V2}:search_optimized_init_scale": "weight_reshape, data_type, bits, imatrix=None, q_scale_thresh=1e-05",
    f"{_AWQ}._grid_search_scales": "self, mapping, x_mean",
    f"{_AWQ}._run_parent_samples": "self, parent, kwargs_list, offload_to_cpu=False",
    f"{_AWQ}._compute_parent_loss": "self, parent, kwargs_list, fp16_outputs",
    f"{_AWQ}._clip_block": "self, block_prefix, block_mappings",
    f"{_AWQ}._compute_best_clip": "self, layer, input_feat",
})

NOT_PATCHED: MappingProxyType[str, str] = MappingProxyType({})

# sha256 (first 16 hex digits) of each source, read on RELEASE
LOOP_REPRODUCED: MappingProxyType[str, str] = MappingProxyType({
    f"{_SR}:SignRoundQuantizer._get_loss": "16731484cd50c5dc",  # dpq.autoround.tune._mse
    # dpq.autoround.tune._select_others (its input_others branch)
    "auto_round.algorithms.block_runner:BlockForwardRunner._select_batch": "28536ad0ffb34ae2",
    "auto_round.algorithms.block_runner:BlockForwardRunner.forward": "4ec3efa90177bf8b",  # tune.lane_forward
})

# dpq.engine.sign_step: pure SignSGD's step, ``param.add_(torch.sign(grad), alpha=-lr)`` per tensor, as one
# foreach op per device and lr (no momentum, no weight decay)
REPRODUCED: MappingProxyType[str, str] = MappingProxyType({
    "auto_round.algorithms.quantization.sign_round.sign_sgd:SignSGD": "f8715df118ee1cfe",
    "auto_round.algorithms.quantization.sign_round.sign_sgd:_use_grad_for_differentiable": "3371f9df5881fe28",
    "auto_round.algorithms.quantization.sign_round.sign_sgd:sgd": "c830617d808c6b98",
    "auto_round.algorithms.quantization.sign_round.sign_sgd:_single_tensor_sgd": "06fa26629f64157d",
})

CALLED: tuple[str, ...] = (
    f"{_SR}:SignRoundQuantizer._compute_valid_token_mask",  # dpq.autoround.block_task
    f"{_SR}:SignRoundQuantizer._maybe_log_low_bit_lr",
    f"{_SR}:SignRoundQuantizer._get_scaler",
    f"{_SR}:SignRoundQuantizer._get_loss",
    "auto_round.algorithms.block_runner:BlockForwardRunner._normalize_output",  # dpq.autoround.tune
    "auto_round.compressors.utils:block_forward",  # dpq.autoround.block_task.lane_block_forward (overlap)
    f"{_RTN}:OptimizedRTNQuantizer._expert_search_active",  # dpq.autoround.seams_rtn
    f"{_RTN}:OptimizedRTNQuantizer._split_expert_batches",
    f"{_AWQ}._iter_parent_calls",  # dpq.autoround.seams_awq
    f"{_AWQ}._normalize_parent_output",
    f"{_AWQ}._should_skip_clip",
)
