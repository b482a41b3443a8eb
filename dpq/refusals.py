"""Every text a user sees when dpq refuses, falls back or rejects an argument, in one place.

Convention (``tests/test_refusals.py`` holds every entry of ``__all__`` to it): a text names the
problem, then ``Fix: `` and what to do about it (for a pass that merely runs on home alone: that
nothing is needed, and how to shard it if wanted). Constants for fixed texts, small functions
for texts that carry values; their parameters are plain strings, numbers and lists of strings,
so it imports nothing, serves the runtime and the auto-round adapter alike, and the rest of dpq
builds no such text inline.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AWQ_BALANCE_ON_META", "AWQ_BALANCE_OUTSIDE", "AWQ_CALLS_NOT_PAIRS", "AWQ_NO_WEIGHTS", "BLOCK_NO_PARAMS",
    "BLOCK_ON_META", "DEBUG_WHILE_OFF", "DEMO_NEEDS_MATPLOTLIB", "DEVICES_WHILE_OFF", "DICT_POOL", "DIST_ACTIVE",
    "EMPTY_DEVICE_LIST", "GRAD_SCALER", "HPU_MULTI_LANE", "INPUTS_NOT_TENSORS", "LFQ_LOSS", "LINES",
    "OFF_UNDER_TORCHRUN", "ONE_LANE", "OUTPUTS_NOT_TENSORS", "OUTPUT_DIR_EMPTY", "OVERLAP_ON_CPU", "OVERLAP_WHILE_OFF",
    "PARALLEL_OFF", "PASS_DICT_POOL", "PASS_DIST_ACTIVE", "PASS_HOOKS_PROCESSES", "REPORT_PATH_EMPTY",
    "RTN_NO_GLOBAL_NAME", "RTN_ON_META", "RUN_STOPPED", "SIGN_STEP_UPSTREAM_CHANGED", "TASKS_UNDER_TORCHRUN",
    "TIMEOUT_WHILE_OFF", "UNSTAGED_FOR_RESUME", "accelerator_shared", "auto_fewest_lanes", "auto_lanes_for_samples",
    "auto_round_missing", "auto_round_unsupported", "auto_shared_device", "auto_world_needs_auto", "awq_lane_failed",
    "awq_parent_hooks", "bad_count", "bad_world", "block_already_quantized", "block_already_wrapped",
    "block_forward_fails", "block_is_a_layer", "block_no_linear", "block_not_module", "block_on_devices",
    "block_spans_devices", "cancelled", "cancelled_after_move", "cancelled_after_save", "collection_lane_failed",
    "count_below_one", "custom_backward", "device_index_too_large", "device_missing", "devices_while_off",
    "dispatch_hooks", "empty_device_list", "forward_replaced", "group_start_failed", "hidden_size_mismatch",
    "home_alone", "hung_process_ends", "inference_tensors", "input_missing", "issuing_thread_hung", "jobs_differ",
    "lane0_not_home", "lane_does_not_fit", "lane_failed", "lane_failed_rerun", "lane_failure", "lanes_hung",
    "malformed_device_entry", "mask_count", "no_accelerator_for_index", "no_quantized_layer", "no_such_device_here",
    "not_a_cpu_index", "not_a_folder", "on_meta", "others_count", "others_device", "others_empty", "others_not_dict",
    "others_not_pairs", "others_on_meta", "output_is_file", "outputs_count", "outputs_shape", "overlap_on_cpu",
    "pass_lane_failed_rerun", "patch_mismatch", "place_unwritable", "plan_bad_home", "plan_model_missing",
    "plan_model_type", "plan_no_blocks", "pool_device", "pool_dtype", "pool_nonfinite", "pool_not_float",
    "pool_on_meta", "pool_spread_devices", "pool_spread_over", "rank_cancelled", "rank_failure", "rank_raised",
    "rank_reported_first", "rank_store_unreachable", "ranks_drew_other_indices", "ranks_silent", "report_in_output",
    "report_is_dir", "report_is_input", "report_is_pipe", "report_not_written", "rotary_length_mismatch",
    "rtn_override", "samples_mismatched", "save_failed", "serial_every_rank", "setting_differs", "setting_type",
    "setting_while_off", "shared_lanes", "staging_leftovers", "symbol_differs", "symbol_missing",
    "timeout_not_a_number", "timeout_out_of_range", "too_few_devices", "too_few_samples", "torch_lacks_type",
    "unknown_scheme", "unmergeable_hooks", "unrecognized_arguments", "unsupported_home", "unused_devices",
    "weights_span", "world_size_without_launcher", "worlds_differ",
]


def _list(names: Sequence[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


# -- the world and the lane devices (dpq.planning.plan) -------------------------------------------

# How a text names a setting, for whoever asked (dpq.planning.plan.PlanRequest.caller,
# dpq.planning.spec.ParallelSpec.caller):
# "cli" auto-round-dp's flags; "enable" the same names as keywords (dpq.autoround.enable, dpq.plan_for);
# "api" dpq.parallel_tune's arguments. A Python caller is told the keyword it typed, never a flag.
_NAMES = {
    "cli": {"world": "--parallel_quantization", "devices": "--parallel_devices", "debug": "--parallel_debug",
            "overlap": "--parallel_overlap", "timeout": "--parallel_timeout", "batch": "--batch_size",
            "order": "--parallel_order"},
    "enable": {"world": "parallel_quantization=", "devices": "parallel_devices=", "debug": "parallel_debug=",
               "overlap": "parallel_overlap=", "timeout": "parallel_timeout=", "batch": "batch_size=",
               "order": "parallel_order="},
    "api": {"world": "world=", "devices": "devices=", "debug": "debug_identical=", "overlap": "overlap=",
            "timeout": "timeout=", "batch": "batch_size=", "order": "order="},
}


def _named(caller: str) -> dict[str, str]:
    return _NAMES.get(caller, _NAMES["cli"])


def _setting(caller: str, key: str, value: object) -> str:
    """The setting ``key`` with ``value`` as the caller writes it: ``--parallel_timeout 5`` on the command
    line (its value as typed), ``parallel_timeout=5`` / ``timeout=5`` in Python (the value's repr)."""
    name = _named(caller)[key]
    return f"{name} {value}" if name.startswith("--") else f"{name}{value!r}"


def _device_list_fix(caller: str = "cli") -> str:
    return f"Fix: {_named(caller)['devices']} with entries like 0,1 or cuda:0,cuda:1 or cpu,cpu"


def empty_device_list(caller: str = "cli") -> str:
    return f"the lane device list is empty. {_device_list_fix(caller)}"


EMPTY_DEVICE_LIST = empty_device_list()
PARALLEL_OFF = ("parallel quantization is off. Fix: --parallel_quantization auto (or a world N) to tune blocks on "
                "lanes")
ONE_LANE = "only one lane available. Fix: --parallel_devices with one device per lane (e.g. 0,1 or cpu,cpu)"
HPU_MULTI_LANE = ("Gaudi's bridge allows one device per process, so several hpu lanes cannot run in one process. "
                  "Fix: one process per Gaudi with one lane each: torchrun --nproc-per-node <Gaudis> -m "
                  "dpq.autoround.cli <args> --parallel_quantization 1 (it starts the HCCL group; not yet run on a "
                  "Gaudi), or from Python init_process_group('hccl') on every rank, then dpq.autoround.enable(1); or "
                  "a single hpu lane")
SIGN_STEP_UPSTREAM_CHANGED = ("dpq: auto-round's SignSGD source differs from the one dpq's one-op sign step reproduces "
                              "(REPRODUCED in dpq.autoround.versions), so every lane runs auto-round's own step: the "
                              "same "
                              "results, more host time per lane. Fix: nothing needed; to get the one-op step back, "
                              "install a checked auto-round (0.16.1 or 0.17.0.dev20261026)")


def bad_world(world: object, caller: str = "cli") -> str:
    example = {"api": "world=2 (or 'auto')", "enable": "parallel_quantization=2 (or 'auto', or 'off')"}.get(
        caller, "--parallel_quantization 2 (or auto, or off)")
    return f"world must be 'off', 'auto' or an integer >= 1, got {world!r}. Fix: pass e.g. {example}."


def device_index_too_large(spec: object, item: str, index: int, limit: int, caller: str = "cli") -> str:
    return (f"lane device list {spec!r}: {item!r} names device index {index}, above {limit}: torch keeps a device "
            f"index in 8 bits, so it would silently become another device. {_device_list_fix(caller)}")


def malformed_device_entry(spec: object, item: object, caller: str = "cli") -> str:
    """``item``: the entry as written (a string, or e.g. a float)."""
    if isinstance(item, str) and not item.strip():
        what = "an empty entry (two commas, or a comma at an end)"
    else:
        what = f"{item.strip()!r} is not a device" if isinstance(item, str) else f"{item!r} is not a device"
    return (f"lane device list {spec!r}: {what}. A lane device is an index (0), a type (cpu) or type:index "
            f"(cuda:1). {_device_list_fix(caller)}")


def no_accelerator_for_index(raw: str) -> str:
    return (f"lane device {raw!r} names accelerator {raw}, but this machine has no cuda, xpu or hpu device (dpq will "
            "not quietly run it on the CPU). Fix: write cpu for a CPU lane, e.g. cpu,cpu")


_TORCH_BUILDS = {  # what to install for lanes of a type the torch build lacks
    "cuda": "a CUDA build of torch: pip install torch --index-url https://download.pytorch.org/whl/cu128 (or the "
            "CUDA version your driver supports, https://pytorch.org/get-started/locally/), then pip install "
            "'auto-round-dp[cuda12]' for CuPy's NCCL",
    "xpu": "an XPU build of torch: pip install torch --index-url https://download.pytorch.org/whl/xpu",
    "hpu": "Intel Gaudi's PyTorch bridge (habana_frameworks), as Intel's Gaudi installer sets it up",
}


def torch_lacks_type(devices: Sequence[str], device_type: str, torch_version: str, driver_seen: bool,
                     example: str, caller: str = "cli") -> str:
    """Lanes of a type this torch build was not compiled for. ``driver_seen``: this machine has the
    vendor's driver (the install is what is wrong); ``example``: lanes that exist here."""
    what = (f"lane device{'s' if len(devices) > 1 else ''} {', '.join(devices)}: this torch ({torch_version}) is a "
            f"build without {device_type} support")
    build = _TORCH_BUILDS.get(device_type, f"a torch build with {device_type} support")
    if driver_seen:
        return f"{what}, though this machine has an NVIDIA driver. Fix: install {build}"
    return (f"{what}, and this machine shows no such device either. Fix: lanes that exist here, e.g. "
            f"{_setting(caller, 'devices', example)}; or, on a machine with {device_type} devices, install {build}")


def no_such_device_here(devices: Sequence[str], device_type: str, count: int, example: str,
                        caller: str = "cli") -> str:
    """Lanes of a type torch supports, with an index this machine does not have."""
    has = f"{count} {device_type} device{'s' if count != 1 else ''}" + (f" ({device_type}:0..{count - 1})"
                                                                         if count > 1 else "")
    return (f"lane device{'s' if len(devices) > 1 else ''} {', '.join(devices)} "
            f"{'do' if len(devices) > 1 else 'does'} not exist: this machine has {has}. Fix: lanes that exist "
            f"here, e.g. {_setting(caller, 'devices', example)}")


def not_a_cpu_index(device: str) -> str:
    return f"lane device {device}: the CPU is one device (cpu or cpu:0). Fix: write cpu, e.g. cpu,cpu"


def device_missing(problem: str, caller: str = "cli") -> str:
    """``problem``: what the device query found (e.g. 'cuda:99 does not exist ...')."""
    return f"{problem}. {_device_list_fix(caller)}"


def lane0_not_home(device: str, home: str, caller: str = "cli") -> str:
    example = (f"devices='{home},...' (or move the block, block.to(...))" if caller == "api" else
               f"--parallel_devices {home},... (or move the model with --device_map)")
    return (f"lane 0 is {device}, but the block is on {home}: lane 0 is the block itself (no copy), so the lane "
            f"device list must start with the block's device. Fix: list {home} first, e.g. {example}")


def lane_does_not_fit(lane: int, device: str, price: int, margin: float, free: int, *, home: bool = False) -> str:
    what = ("home (lane 0) needs ~{:.2f} GiB more for its share (fp32 tuning values, gradient buffer, exchange "
            "scratch, staging, activations" if home else
            "a mirror needs ~{:.2f} GiB (weights + fp32 tuning values + activations").format(price / 2**30)
    return (f"lane {lane} on {device}: {what} + {margin - 1:.0%} margin) but only {free / 2**30:.2f} GiB is free for "
            "it. Fix: fewer lanes, a smaller --batch_size, or --low_gpu_mem_usage")


def unsupported_home(device_type: str) -> str:
    return (f"home device type {device_type!r} is not supported (cuda, xpu, hpu, cpu). Fix: load the model on one "
            "of those (--device_map), or --parallel_quantization off")


def unused_devices(world: int, given: int, unused: Sequence[str], caller: str = "cli") -> str:
    return (f"world {world} runs on the first {world} of the {given} lane devices given; {_list(unused, 8)} "
            f"not used. Fix: {_named(caller)['world']} {given} to use them all")


def too_few_devices(world: int, named: Sequence[str], given: bool, caller: str = "cli") -> str:
    n, arg = len(named), _named(caller)
    return (f"world {world} needs {world} lane devices but {n} {'was' if n == 1 else 'were'} "
            f"{'given' if given else 'found'}{' (' + _list(named, 8) + ')' if named else ''}. Fix: "
            f"{arg['devices']} with one device per lane (e.g. cpu,cpu or 0,1), or a smaller {arg['world']}")


def count_below_one(flag: str, value: object) -> str:
    """An auto-round count (--nsamples, --batch_size, --gradient_accumulate_steps) under 1 with dpq on:
    an iteration would have no sample for any lane."""
    return (f"{flag} {value}: an iteration would have no sample to tune on, on any lane. Fix: {flag} 1 or more "
            "(auto-round's default when left out)")


def too_few_samples(lanes: int, samples: int, pool: int = 0, caller: str = "cli", processes: int = 1,
                    asked: int = 0) -> str:
    """``samples`` per iteration: the smaller of ``pool`` (the calibration samples there are; 0: not
    known) and batch_size x gradient_accumulate_steps; the fix raises the one that limits it: the data
    itself where it holds fewer than the ``asked`` --nsamples. ``processes`` > 1: the lanes are that many
    processes' (torchrun), each running lanes / processes."""
    arg = _named(caller)
    s = "s" if samples != 1 else ""
    if pool and pool <= samples and asked and pool < asked and caller != "api":  # the data is short, not the ask
        limit = f"the calibration data gives {pool} sample{'s' if pool != 1 else ''}, of the {asked} --nsamples asks"
        more = (f"calibration data that gives at least {lanes} samples (another --dataset; auto-round drops texts "
                "shorter than --seqlen)")
    elif pool and pool <= samples:  # the calibration data is the limit, whatever the batch size
        limit = (f"the calibration data has {pool} sample{'s' if pool != 1 else ''}" if caller != "api" else
                 f"inputs holds {pool} sample{'s' if pool != 1 else ''}")
        more = f"--nsamples {lanes} or more" if caller != "api" else f"at least {lanes} inputs (one tensor each)"
    else:
        limit, more = "batch_size x gradient_accumulate_steps", f"{arg['batch']} {lanes} or more"
    if lanes > 4096:  # a fix sized by an absurd request helps no one: the world is what to change
        return (f"{lanes} lanes but only {samples} sample{s} per iteration ({limit}): every lane needs at least one "
                f"sample. Fix: a smaller {arg['world']} (at most {max(1, samples // processes)}"
                f"{' per process' if processes > 1 else ''})")
    if processes > 1:
        what = f"{lanes} lanes ({processes} processes x {lanes // processes})"
        per_process = samples // processes
        fewer = (f"--parallel_quantization {per_process} per process" if per_process >= 1 else
                 f"at most {samples} process{'es' if samples != 1 else ''} (torchrun --nproc-per-node)")
        return (f"{what} but only {samples} sample{s} per iteration ({limit}): every lane needs at least one "
                f"sample. Fix: {more}, or fewer lanes: {fewer}")
    return (f"{lanes} lanes but only {samples} sample{s} per iteration ({limit}): every lane needs at least one "
            f"sample. Fix: {more}, or a smaller {arg['world']} (at most {samples})")


def devices_while_off(caller: str = "cli") -> str:
    arg = _named(caller)
    return ("lane devices were given but parallel quantization is off, so they would be ignored. Fix: add "
            f"{_setting(caller, 'world', 'auto')} (or a world N), or drop {arg['devices'].rstrip('=')}")


DEVICES_WHILE_OFF = devices_while_off()


# -- what the tuner or a block uses that lanes cannot split (dpq.autoround) ---------------------

DIST_ACTIVE = ("a torch.distributed group is initialised but dpq was not given it, so this process would tune the "
               "block alone while the others do the same. Fix: launch with torchrun and auto-round-dp (it passes the "
               "group on), or call dpq.autoround.enable() after torch.distributed.init_process_group, or "
               "--parallel_quantization off")
DICT_POOL = ("calibration inputs are not a flat list of tensors (diffusion-style dict pool). Fix: "
             "--parallel_quantization off for this model")
GRAD_SCALER = ("a gradient scaler is in use (AdamRound under fp16 amp). Fix: --disable_amp or "
               "--parallel_quantization off")
LFQ_LOSS = ("LFQ loss (--enable_lfq) needs the lm_head on every lane. Fix: turn --enable_lfq off, or "
            "--parallel_quantization off")


def custom_backward(quantizer: str) -> str:
    """``quantizer``: the class name of a quantizer whose ``_scale_loss_and_backward`` dpq does not know."""
    return (f"{quantizer} overrides the backward step; dpq only knows SignRound's and AdamRound's. Fix: "
            "--parallel_quantization off")


def block_spans_devices(n: int, devices: Sequence[str]) -> str:
    """``--device_map`` split a block that did not fit one device (``integration._dispatch``)."""
    return (f"the block's weights span {n} devices ({devices}): a block that does not fit one device keeps "
            "auto-round's split placement, serially. Fix: none needed; for lanes, a device with room for the whole "
            "block (a smaller --batch_size, --low_gpu_mem_usage)")


# -- a pass that runs on home alone (dpq.autoround's seams): same result, not sharded ------------


def home_alone(problem: str, fix: str = "") -> str:
    """A no-grad pass's reason to run on home alone: nothing to fix for the result (bitwise the
    same), ``fix`` to shard it."""
    return f"{problem}: this pass runs on home alone (same result). Fix: none needed{'; ' + fix if fix else ''}"


PASS_DIST_ACTIVE = home_alone(
    "several processes (torch.distributed): every rank runs this no-grad pass on its own home device (its result is "
    "bitwise the serial one, so every rank holds the same)", "one process with several lanes shards it")
PASS_DICT_POOL = home_alone("the pool is not a flat list of tensors (diffusion-style dict pool)")
AWQ_NO_WEIGHTS = home_alone("the parent has no weights")
AWQ_BALANCE_OUTSIDE = home_alone("a balance layer is outside the replayed parent")
AWQ_CALLS_NOT_PAIRS = home_alone("the cached parent calls are not (args, kwargs) pairs")
RTN_NO_GLOBAL_NAME = home_alone("a target layer has no global_name")
RTN_ON_META = home_alone("a target layer is on the meta device (disk streaming)",
                         "load the model into memory to shard it")
AWQ_BALANCE_ON_META = home_alone("a balance layer is on the meta device (disk streaming)",
                                 "load the model into memory to shard it")


def unmergeable_hooks(hooks: Sequence[str]) -> str:
    """Hooks on a block whose statistics dpq cannot merge across lanes (``seams_common``'s table)."""
    return home_alone(f"hooks without a merge rule: {list(hooks)}",
                      "none for these hooks (a merge rule per hook lives in dpq.autoround.seams_collection)")


def awq_parent_hooks(hooks: Sequence[str]) -> str:
    return home_alone(f"hooks on the parent: {list(hooks)} (a replay on a mirror would fire them there)")


def rtn_override(quantizer: str, method: str) -> str:
    return home_alone(f"{quantizer} overrides {method}", "none: dpq shards auto-round's own search only")


def weights_span(label: str, n: int) -> str:
    return home_alone(f"the {label}'s weights span {n} devices (auto-round's split placement)",
                      "room for the whole block on one device shards it")


def on_meta(label: str) -> str:
    return home_alone(f"the {label} is on the meta device (disk streaming)", "load the model into memory to shard it")


def dispatch_hooks(label: str) -> str:
    return home_alone(f"the {label} carries accelerate dispatch hooks",
                      "load the model without offloading (--device_map with one device) to shard it")


def forward_replaced(name: str, kind: str) -> str:
    return home_alone(f"{name} has its forward replaced by {kind}", "nothing dpq can do: the replacement owns it")


def pool_spread_devices(n: int, devices: Sequence[str]) -> str:
    """A no-grad pass over a pool spread over several devices runs on home alone."""
    return home_alone(f"the calibration pool is spread over {n} devices ({devices})",
                      "--calibration_data_device with a single device to shard it")


# -- 'auto''s cost model (dpq.planning.cost_model through dpq.autoround.integration) --------------


def auto_world_needs_auto(world: object) -> str:  # enable(world, auto_world=...) with a world other than 'auto'
    return (f"auto_world was given but the world is {world!r}: only 'auto' chooses the world by predicted time, so "
            "it would be ignored. Fix: parallel_quantization='auto', or drop auto_world")


def auto_shared_device(lanes: int, devices: Sequence[str]) -> str:
    """A plan note (not a refusal): 'auto' runs every fitting lane on a shared device, which buys no speed."""
    return f"auto: every fitting lane runs ({lanes}), {shared_lanes(devices)}"


def shared_lanes(devices: Sequence[str]) -> str:
    """Lanes that share ``devices`` (fewer devices than lanes): the plan screen's row and auto's line."""
    where = "one CPU" if list(devices) == ["cpu"] else ", ".join(devices)
    return (f"no speedup: these lanes share {where} and take turns on it, so the block takes at least as long as on "
            "one lane (they run in parity: useful for testing). Fix: for speed, one lane per accelerator "
            "(--parallel_devices 0,1,...), or --parallel_quantization off")


# -- dpq.parallel_tune's arguments (dpq.autoround.api) ------------------------------------------


def pool_not_float(name: str, dtypes: str) -> str:
    return (f"{name} are {dtypes}: parallel_tune takes the block's hidden states (floating point), not token ids. "
            "Fix: capture the layer's inputs and outputs, e.g. with dpq.demo.model.capture_block_inputs or from "
            "auto-round's cache")


def pool_dtype(name: str, dtypes: str) -> str:
    return (f"{name} are {dtypes}: blocks are tuned in float32, float16 or bfloat16. Fix: cast them to the block's "
            f"dtype, e.g. [t.to(torch.float32) for t in {name}]")


def pool_on_meta(name: str) -> str:
    return (f"{name} are on the meta device: they have no values. Fix: pass the tensors captured from a real forward "
            "of the model")


def pool_spread_over(name: str, devices: str) -> str:
    return f"{name} are spread over {devices}. Fix: put every sample on one device: the block's, or the CPU"


def pool_device(name: str, device: str, home: str) -> str:
    return (f"{name} are on {device} but the block is on {home}. Fix: move them to {home}, or keep them on the CPU "
            "(each batch is copied to the lanes)")


def pool_nonfinite(name: str, bad: Sequence[int], total: int) -> str:
    return (f"{name} {list(bad[:5])}{' ...' if len(bad) > 5 else ''} contain NaN or inf ({len(bad)} of {total} "
            "samples): every loss would be NaN. Fix: recompute them from the fp model (an fp16 overflow upstream? "
            "run it in bfloat16 or float32)")


INPUTS_NOT_TENSORS = "inputs must be a non-empty list of tensors. Fix: pass one [1, seq, hidden] tensor per sample"


def samples_mismatched(shape0: Sequence[int], bad: Sequence[int], example: Sequence[int]) -> str:
    return (f"inputs have mismatched shapes: sample 0 is {tuple(shape0)} but samples {list(bad[:5])} differ "
            f"(e.g. {tuple(example)}). Fix: pad or truncate every sample to one sequence length")


def hidden_size_mismatch(size: int, widths: Sequence[str]) -> str:
    """``widths``: the input widths of the block's Linear layers (one of them takes the hidden states)."""
    return (f"inputs have hidden size {size} (their last dimension), but none of the block's Linear layers takes "
            f"{size} features (they take {', '.join(widths)}): these are not this block's inputs. Fix: pass the "
            "hidden states that enter this block, e.g. captured with dpq.demo.model.capture_block_inputs or from "
            "auto-round's cache")


def block_forward_fails(block: str, err: str, given: Sequence[str], missing: Sequence[str]) -> str:
    """``dpq.parallel_tune``: the block's forward failed on inputs[0] with input_others as given;
    ``missing``: the keywords its forward takes that input_others does not give."""
    gave = f"input_others gives {', '.join(given)}" if given else "no input_others"
    lacks = (f" {block}.forward also takes {', '.join(missing)}, which input_others does not give"
             + (" (position_embeddings: the rotary (cos, sin) pair the model computes for these positions)"
                if "position_embeddings" in missing else "") + "." if missing else "")
    return (f"the block's forward fails on inputs[0] with {gave}: {err}.{lacks} Fix: pass input_others as the "
            "model hands them to this block (as auto-round caches them), e.g. captured with "
            "dpq.demo.model.capture_block_inputs")


def rotary_length_mismatch(length: int, seq: int) -> str:
    return (f"input_others['position_embeddings'] cover {length} positions but the inputs have {seq}. Fix: pass "
            "the (cos, sin) pairs computed for these inputs' sequence length, or leave the key out")


OUTPUTS_NOT_TENSORS = ("outputs must be a list of tensors. Fix: one reference output per input, or None to compute "
                       "them from the fp block")


def outputs_count(outputs: int, inputs: int) -> str:
    return f"outputs has {outputs} samples but inputs has {inputs}. Fix: give one output per input"


def outputs_shape(bad: Sequence[int]) -> str:
    return (f"outputs {list(bad[:5])} do not have their inputs' shape (a block's output has its input's batch, "
            "sequence and hidden size). Fix: pass each input's own block output, in the same order")


def others_count(key: str, n: int) -> str:
    return f"input_others[{key!r}] has {n} entries. Fix: give one per sample, or one shared"


def others_empty(key: str) -> str:
    """An empty list or tuple in ``input_others`` (the block's forward would unpack or index nothing)."""
    return (f"input_others[{key!r}] is empty. Fix: give the values the block's forward takes (one per sample, or one "
            "shared), or leave the key out")


def others_not_pairs(key: str) -> str:
    return (f"input_others[{key!r}] must hold (cos, sin) pairs, one per sample or one shared, as the rotary embedding "
            "returns them. Fix: pass the pairs captured from the model's forward, or leave the key out")


def inference_tensors(where: Sequence[str]) -> str:
    """``where``: what holds tensors made under ``torch.inference_mode()`` ('inputs', 'the block's weights', ...)."""
    return (f"{_list(where)} hold inference tensors (made under torch.inference_mode()), which autograd cannot save "
            "for the tuning's backward. Fix: capture them under torch.no_grad() instead, or pass clones made outside "
            "inference mode (t.clone()); for the block, load or build the model outside inference mode")


_SETTING_KINDS = {"count": "an integer >= 1", "int": "an integer", "int or None": "an integer or None",
                  "positive": "a finite number > 0, or None", "non-negative": "a finite number >= 0, or None",
                  "bits": "an integer >= 1 (e.g. 4), or None for the scheme's", "group": (
                      "-1 (one group per output channel), 0 (the whole tensor) or an integer >= 1 (e.g. 128), or "
                      "None for the scheme's")}


def setting_type(name: str, value: str, kind: str = "count", where: str = "dpq.parallel_tune") -> str:
    """``value``: repr of what was given; ``kind``: a key of ``_SETTING_KINDS`` (what ``name`` must be);
    ``where``: the function whose keyword it is."""
    want = _SETTING_KINDS[kind]
    return f"{name} must be {want}, got {value}. Fix: pass {name} as {want} (see {where}'s defaults)"


def plan_model_missing(model: str) -> str:
    """``dpq.plan_for(model)`` with a local path (absolute, or starting with . or ~) that is not there."""
    return (f"model {model!r} is a path, but nothing is there. Fix: a model folder (with its config.json), a hub id "
            "such as 'Qwen/Qwen3-8B', or a model object")


def plan_model_type(kind: str) -> str:
    return (f"model is a {kind}, not a model. Fix: a model folder (with its config.json), a hub id such as "
            "'Qwen/Qwen3-8B', or a model object (torch.nn.Module)")


def plan_no_blocks(kind: str) -> str:
    return (f"the model ({kind}) has no repeated transformer blocks (auto-round's get_block_names finds none), so "
            "there is no block to price. Fix: pass the whole model (e.g. AutoModelForCausalLM), not one layer")


def plan_bad_home(home: str, why: str = "is not a device") -> str:
    """``why``: what is wrong with it (not a device; a device this machine or torch build lacks)."""
    return (f"home={home!r} {why}. Fix: home='cpu', 'cuda:0' (or None: the first lane's device), as "
            "--device_map names the block's device")


def others_not_dict(kind: str) -> str:
    return (f"input_others is a {kind}, not a dict. Fix: pass the block's extra forward keywords as a dict, as "
            "auto-round caches them (e.g. {'position_embeddings': (cos, sin), 'attention_mask': None}), or None")


def block_not_module(kind: str) -> str:
    return (f"block is a {kind}, not a torch.nn.Module. Fix: pass one transformer block, e.g. "
            "model.model.layers[0]")


def block_is_a_layer(kind: str) -> str:
    return (f"the block is itself a {kind}: auto-round's wrapper replaces the quantizable layers inside a block by "
            "name, and a block has none of its own. Fix: pass the transformer block that holds it (e.g. "
            "model.model.layers[0]), or wrap it: torch.nn.Sequential(layer)")


def mask_count(kind: str, inputs: int) -> str:
    return (f"valid_token_mask is {kind}, but there are {inputs} inputs. Fix: one mask tensor per input, or None")


def others_on_meta(key: str) -> str:
    return f"input_others[{key!r}] is on the meta device. Fix: pass the values captured from a real forward"


def others_device(key: str, devices: str, device: str) -> str:
    return f"input_others[{key!r}] is on {devices} but the inputs are on {device}. Fix: move it to {device}"


BLOCK_NO_PARAMS = ("the block has no parameters: there is nothing to tune. Fix: pass a block with its weights, e.g. a "
                  "decoder layer (model.model.layers[i])")
BLOCK_ON_META = ("the block's weights are on the meta device (not loaded: an empty-weights or offloaded model). Fix: "
                "load the block's weights onto its device first")


def block_on_devices(devices: str) -> str:
    return f"the block's weights span {devices}. Fix: move the block to one device, e.g. block.to('cuda:0')"


def block_already_wrapped(names: Sequence[str]) -> str:
    return (f"the block is already wrapped for tuning ({_list(names)}: auto-round's wrapper_block put wrappers "
            "around them). Fix: pass the block as it was before wrapping (each wrapper's .orig_layer is the "
            "original layer)")


def block_already_quantized(names: Sequence[str], packed: bool) -> str:
    what = "are packed (qweight)" if packed else "carry the scale/zp that auto-round's unwrap leaves"
    return (f"the block is already quantized ({_list(names)} {what}): tuning it again would round already rounded "
            "weights. Fix: pass the fp block (a copy taken before quantizing, or the reloaded model's layer)")


def block_no_linear(kinds: Sequence[str]) -> str:
    return (f"the block has no Linear layer to quantize (its weights are in {', '.join(kinds[:5])}): SignRound "
            "tunes Linear weights. Fix: pass a block with Linear layers, e.g. a decoder layer")


def unknown_scheme(scheme: str) -> str:
    return f"unknown scheme {scheme!r}. Fix: one of auto-round's preset names, e.g. 'W4A16'"


def no_quantized_layer(bits: Sequence[str]) -> str:
    return (f"no layer of the block would be quantized: bits {sorted(bits)} (auto-round quantizes bits <= 8 only). "
            "Fix: bits <= 8, e.g. scheme='W4A16'")


def bad_count(iters: object = None, batch_size: object = None, accumulate: object = None) -> str:
    """``iters`` < 1, or ``batch_size`` / ``accumulate`` (gradient_accumulate_steps) < 1."""
    if iters is not None:
        return f"iters must be >= 1, got {iters!r}. Fix: e.g. iters=200 (auto-round's default)"
    return (f"batch_size and gradient_accumulate_steps must be >= 1, got {batch_size} and {accumulate}. Fix: e.g. "
            "batch_size=8, gradient_accumulate_steps=1")


# -- auto-round-dp's flags (dpq.autoround.cli) --------------------------------------------------

def unrecognized_arguments(extras: str, typed: Sequence[str], meant: Sequence[str]) -> str:
    """argparse's "unrecognized arguments", with the flag each of ``typed`` most likely meant (``meant``)."""
    if not typed:
        return f"unrecognized arguments: {extras}. Fix: the arguments as --help lists them"
    pairs = ", ".join(f"{m} for {t}" if len(typed) > 1 else m for t, m in zip(typed, meant, strict=True))
    return f"unrecognized arguments: {extras}. Did you mean {pairs}? Fix: write {', '.join(meant)}"


_REPORT_FIX = "Fix: --parallel_report with a file path in a writable folder, e.g. ./dpq_report.json"
def setting_while_off(key: str = "debug", caller: str = "cli") -> str:
    """``key`` (debug, overlap, timeout) asked for while the world is off, where it has no effect."""
    arg = _named(caller)
    flag = arg[key].rstrip("=")
    default = " (the default)" if caller == "cli" else ""
    return (f"{flag} has no effect with {_setting(caller, 'world', 'off')}{default}. "
            f"Fix: add {_setting(caller, 'world', 'auto')} (or a world N), or drop {flag}")


DEBUG_WHILE_OFF = setting_while_off("debug")
OVERLAP_WHILE_OFF = setting_while_off("overlap")
TIMEOUT_WHILE_OFF = setting_while_off("timeout")


def overlap_on_cpu(caller: str = "cli") -> str:
    arg = _named(caller)
    return (f"{arg['overlap'].rstrip('=')} has no effect on CPU lanes: it puts the exchange on a second stream per "
            "GPU lane, and CPU lanes (which have no streams) exchange during the backward anyway. Fix: drop "
            f"{arg['overlap'].rstrip('=')} (auto), or GPU lanes ({_setting(caller, 'devices', '0,1')})")


OVERLAP_ON_CPU = overlap_on_cpu()


def bad_overlap(value: object, caller: str = "cli") -> str:
    if caller == "cli":
        return (f"--parallel_overlap {value!r} is not a setting. Fix: auto (the default: on where the lane GPUs "
                "have no peer access), on, or off")
    return (f"{_named(caller)['overlap']}{value!r} is not a setting. Fix: 'auto' (the default: on where the lane "
            "GPUs have no peer access; or None), 'on' (or True), or 'off' (or False)")


def bad_order(value: object, caller: str = "cli") -> str:
    if caller == "cli":
        return (f"--parallel_order {value!r} is not a setting. Fix: canonical (the default: the bits depend on the "
                "world alone) or native (NCCL's own sums)")
    return (f"{_named(caller)['order']}{value!r} is not a setting. Fix: 'canonical' (the default: the bits depend "
            "on the world alone) or 'native' (NCCL's own sums)")


REPORT_PATH_EMPTY = f"--parallel_report is empty. {_REPORT_FIX}"


def report_is_dir(path: str, suggestion: str) -> str:
    return f"--parallel_report {path} is a directory; the report is one JSON file. Fix: e.g. --parallel_report " \
        f"{suggestion}"


_OUTPUT_FIX = "Fix: --output_dir with a folder this user can write (it is made if missing)"


def _place_fix(flag: str) -> str:
    """The fix for a place ``flag`` (--output_dir, else --parallel_report) cannot write."""
    return _OUTPUT_FIX if flag == "--output_dir" else _REPORT_FIX


def not_a_folder(flag: str, path: str, blocker: str) -> str:
    """``blocker``: the existing file on ``path``'s way where a folder must be."""
    return f"{flag} {path}: {blocker} is a file, not a folder, so nothing can be made under it. {_place_fix(flag)}"


def place_unwritable(flag: str, path: str, where: str) -> str:
    """``where``: the file, or the nearest existing folder, that this user cannot write."""
    return (f"{flag} {path} cannot be written: {where} takes no writes from this process (a read-only file "
            f"system, or not this user's). {_place_fix(flag)}")


def report_in_output(path: str, output_dir: str) -> str:
    return (f"--parallel_report {path} is where auto-round saves the model in --output_dir {output_dir} (its model "
            "folder, or a model file's name): the report would overwrite one of the model's files (e.g. its "
            "config.json) or be replaced by the save. Fix: a path outside the model's folder, e.g. --parallel_report "
            f"{output_dir.rstrip('/') or '.'}/dpq_report.json")


def report_is_pipe(path: str) -> str:
    return (f"--parallel_report {path} is a pipe (or a socket): writing the report would wait, once the model is "
            f"saved, until something reads it. {_REPORT_FIX}")


def report_is_input(path: str, flag: str, value: str, output_dir: str) -> str:
    """The report path is (or is inside) what the run reads: ``flag`` ``value`` as given."""
    return (f"--parallel_report {path} is where this run reads {flag} {value}: the report would overwrite the "
            f"user's input (or be written into it), and the next run on the same model or data would read a JSON "
            f"report instead. Fix: a path outside the run's inputs, e.g. --parallel_report "
            f"{output_dir.rstrip('/') or '.'}/dpq_report.json")


def report_would_replace(path: str, output_dir: str) -> str:
    """The report path is an existing file that is neither empty nor an earlier dpq report."""
    return (f"--parallel_report {path} is an existing file that is not a dpq report: writing the report would "
            f"replace it whole. Fix: a new path (or an earlier report's), e.g. --parallel_report "
            f"{output_dir.rstrip('/') or '.'}/dpq_report.json")


OUTPUT_DIR_EMPTY = ("--output_dir is empty: auto-round would save the model into the working directory itself. "
                    "Fix: --output_dir with a folder for the model, e.g. --output_dir ./tmp_autoround (the default)")


def input_missing(flag: str, path: str) -> str:
    """--model or --dataset written as a local path where nothing is (auto-round would take it for a hub id)."""
    what = "a model folder (with its config.json)" if flag == "--model" else "a calibration file"
    return (f"{flag} {path} is a path, but nothing is there. Fix: the path of {what}, or a hub id such as "
            f"{'Qwen/Qwen3-8B' if flag == '--model' else 'NeelNanda/pile-10k'}")


def output_is_file(path: str) -> str:
    return (f"--output_dir {path} is an existing file, not a folder: auto-round saves the model into a folder there. "
            "Fix: another --output_dir, or move that file away")


def report_not_written(path: str, why: str, model_complete: bool) -> str:
    """The report could not be written at the run's end (checked at start; the place may have changed since)."""
    model = ("the model is complete and in place (exit status 0)" if model_complete else
             "the run's own failure is said above")
    return (f"--parallel_report {path} could not be written ({why}); {model}. Fix: a --parallel_report in a folder "
            "with room that this user can write, next time")


def cancelled(cause: str) -> str:
    """``cause``: 'SIGTERM', 'SIGINT', or 'its launcher is gone' (dpq.cancel.what)."""
    return (f"the run was cancelled ({cause}) and stopped: nothing is written after a cancel, so --output_dir is left "
            "as it was (a model saved there before is untouched). Fix: rerun the command to quantize the model")


def cancelled_after_move(cause: str) -> str:
    return (f"the run was cancelled ({cause}) while its finished model was being moved into --output_dir: that move "
            "completed, so --output_dir holds the whole new model. Fix: none needed; the model is complete")


def cancelled_after_save(cause: str) -> str:
    return (f"the run was cancelled ({cause}) after its finished model was moved into --output_dir, which holds the "
            "whole new model (what came after, such as the report, may be missing). Fix: none needed; the model "
            "is complete")


def staging_leftovers(folders: Sequence[str]) -> str:
    """Staging folders (dpq.staging) of runs into the same --output_dir that were killed before they could
    remove them, each holding part of a model."""
    return (f"runs into this --output_dir that were killed left part of their output in {', '.join(folders)} (never "
            "a complete model; dpq removes such a folder by itself only when it holds nothing). Fix: remove them "
            "(rm -r) to free the space; --output_dir itself is not affected")


DEMO_NEEDS_MATPLOTLIB = ("python -m dpq.demo draws its figure with matplotlib, which is not installed. Fix: pip "
                         "install 'auto-round-dp[demo]' (or pip install matplotlib)")
def save_failed(output_dir: str, err: str, staged: bool = True) -> str:
    """Writing the model failed (a full disk, a quota, a read-only mount). ``staged``: dpq staged the output,
    and removed it; else (--parallel_quantization off) auto-round wrote into --output_dir itself."""
    kept = ("--output_dir is left as it was (what this run wrote was removed; a model saved there before is "
            "untouched)" if staged else
            "with --parallel_quantization off auto-round writes into --output_dir itself, so it may hold part of "
            "this model (a model saved there before may be partly overwritten)")
    return (f"saving the model into --output_dir {output_dir} failed: {err}. {kept}. Fix: free space (or quota) "
            "where --output_dir is, or another --output_dir, then rerun the command")


RUN_STOPPED = ("the run stopped before auto-round saved a model: the blocks quantized so far end with this process, "
               "and --output_dir is left as it was (what the run wrote was removed; a model saved there before is "
               "untouched). Fix: rerun the command with --parallel_quantization auto or off")

UNSTAGED_FOR_RESUME = ("AR_RESUME_DIR is set: auto-round's resume reuses the shards a failed run left in --output_dir, "
                       "so the output is written there directly, not staged beside it (a failed run leaves a partial "
                       "model there). Fix: none needed for a resumable run; unset AR_RESUME_DIR to have the output "
                       "moved into place only once whole")


# -- lane failures (the failure policy, contract 6) ----------------------------------------------

_RERUN_FIX = "Fix: rerun the quantization with --parallel_quantization auto (a block whose lane fails is redone " \
             "serially) or off"


def lane_failed(where: str, block: str, world: int, err: str, done: Sequence[str]) -> str:
    """An explicit world's lane failure in ``block``; ``done``: the blocks finished before it."""
    shown = ", ".join(done) if len(done) <= 4 else f"{', '.join(done[:2])}, ..., {done[-1]}"
    kept = (f"The {len(done)} block(s) finished before it ({shown}) stay quantized in place in the model object, in "
            "this process only (auto-round writes a complete model only when the whole run ends, and a run cannot "
            "resume from the middle).") if done else "No block had been finished before it."
    return (f"dpq: a lane failed {where} {block} at world {world}: {err}. {block} is back as it was before its work "
            f"started. {kept} {_RERUN_FIX}")


def lane_failed_rerun(block: str, err: str) -> str:
    """``auto``: a lane failed, the block was restored and is rerun serially."""
    return (f"dpq: a lane failed on {block} ({err}); block restored, rerunning serially. Fix: none needed for this "
            "block; if lanes fail on every block, --parallel_quantization off skips the attempts")


def collection_lane_failed(block: str, world: int, err: str) -> str:
    return (f"dpq: a lane failed in a collection pass of {block} at world {world}: {err}. The home block's statistics "
            "were restored; nothing already quantized was lost. Fix: rerun with --parallel_quantization auto (falls "
            "back to serial per pass) or off")


def awq_lane_failed(what: str, block: str, world: int, err: str) -> str:
    return (f"dpq: a lane failed in the {what} of {block} at world {world}: {err}. The balance weights were restored. "
            "Fix: rerun with --parallel_quantization auto (falls back to serial) or off")


def pass_lane_failed_rerun(what: str, err: str, restored: str) -> str:
    """``auto``: a lane failed in a no-grad pass (``what``), ``restored`` was put back, the pass reruns on home."""
    return (f"dpq: a lane failed in {what} ({err}); {restored} restored, rerunning it on home. Fix: none needed (same "
            "result); if lanes fail on every pass, --parallel_quantization off skips the attempts")


def lane_failure(err: str) -> str:
    """A record's reason when ``auto`` reran a block or a pass serially after a lane failure."""
    return f"lane failure: {err}. Fix: none needed (rerun serially, same result as auto-round's own)"


def lanes_hung(block: str, world: int, communicator: str, lanes: str, waited_s: float, cause: str,
               ended: bool) -> str:
    """The watchdog (dpq.tune_loop): an iteration's readback passed --parallel_timeout, or the communicator
    reported an asynchronous error (``cause``); ``lanes``: those whose work had not finished; ``ended``:
    aborting the communicator ended the work queued on the lanes (NCCL's abort), so home can be restored."""
    what = f"{block} at world {world}: lane(s) {lanes} had not finished an iteration after {waited_s:.1f} s ({cause})"
    if ended:
        return (f"{what}; the {communicator} communicators were aborted, which ends their queued work, and these GPUs "
                "use device copies for the rest of this run. Fix: if the block's iterations are that slow, raise "
                "--parallel_timeout; otherwise rerun with NCCL_DEBUG=WARN for NCCL's own reason (under "
                "--parallel_quantization auto such a block is redone serially)")
    return (f"{what}; the {communicator} communicator cannot end work already queued on the GPUs (torch.cuda.nccl has "
            "no abort, a copy between devices has none either), so this process cannot use those GPUs again and the "
            "block could not be put back. Fix: restart the run; install CuPy's NCCL (pip install "
            "auto-round-dp[cuda12]), whose communicators can be aborted, or raise --parallel_timeout if the block's "
            "iterations are that slow")


def issuing_thread_hung(block: str, world: int, doing: str, iteration: int, waited_s: float, timeout_s: float,
                        communicator: str, aborted: bool) -> str:
    """The iteration watchdog (dpq.engine.watchdog): the issuing thread spent --parallel_timeout in one iteration
    outside the waits that check their own deadline; ``doing``: where it was (e.g. "lane 0's forward");
    ``aborted``: aborting the communicator ended work it may wait for (NCCL's abort)."""
    comm = (f"the {communicator} communicators were aborted, which ends the collectives it may wait for" if aborted
            else f"the {communicator} communicator has no queued work an abort could end")
    return (f"{block} at world {world}: the issuing thread has been in {doing} (iteration {iteration}) for "
            f"{waited_s:.1f} s, past --parallel_timeout {timeout_s:g} s, stuck where no check of its own runs (a "
            f"device or NCCL call, a C library); {comm}. Fix: if an iteration of this block takes that long (a "
            "first iteration's torch.compile, a large block on a slow device), raise --parallel_timeout; otherwise "
            "see what the thread waits for (py-spy dump --pid <pid>; NCCL_DEBUG=WARN for NCCL) and rerun")


def hung_process_ends(hung: str, grace_s: float) -> str:
    """``hung``: :func:`issuing_thread_hung`'s text; the thread did not come back ``grace_s`` later, so the
    command's process ends (the staging folder removed, the report written)."""
    problem, _, fix = hung.partition(" Fix: ")
    fix = fix or "raise --parallel_timeout if this block's iterations take that long"
    return (f"{problem.rstrip('. ')}. It did not come back within {grace_s:g} s more and cannot be stopped from "
            "outside, so this process ends (exit status 1): --output_dir is left as it was (what the run wrote was "
            "removed), and --parallel_report, if given, names this block and the blocks finished before it. Fix: "
            + fix)


# -- the installed auto-round (dpq.autoround.compat, dpq.autoround.patches) ----------------------


def auto_round_missing(pip_bound: str) -> str:
    return f"dpq.autoround needs auto-round 0.16.x or 0.17.x. Fix: pip install '{pip_bound}'"


def auto_round_unsupported(supported: Sequence[str], version: str, pip_bound: str) -> str:
    return (f"dpq.autoround supports auto-round {' and '.join(s + '.x' for s in supported)} (it replaces auto-round "
            f"internals listed in dpq.autoround.patches), but auto-round {version} is installed. "
            f"Fix: pip install '{pip_bound}', or run plain auto-round without dpq.")


def symbol_missing(symbol: str, error: str = "") -> str:
    return f"{symbol} is missing" + (f" ({error})" if error else "")


def symbol_differs(symbol: str, found: str, checked: str) -> str:
    return f"{symbol}({found}) differs from the checked ({checked})"


def source_differs(symbol: str, found: str, checked: str) -> str:
    return f"{symbol}: its source (sha256 {found}) differs from the one dpq reproduces (sha256 {checked})"


# parts of another text, which names the fix: patch_mismatch's lines (symbol_*), rank_failure's heads
LINES = ("symbol_differs", "source_differs", "symbol_missing", "rank_raised", "rank_reported_first",
         "rank_store_unreachable", "ranks_silent", "rank_cancelled", "setting_differs")


def patch_mismatch(version: str, checked: Sequence[str], problems: Sequence[str]) -> str:
    return (f"dpq: auto-round {version} is installed, and these functions dpq replaces or reproduces differ from "
            f"the ones dpq checked (auto-round {', '.join(checked)}):\n" + "\n".join(f"  - {x}" for x in problems)
            + "\ndpq does not run a changed upstream function through its copy. Fix: install a checked auto-round "
            "(pip install 'auto-round==0.16.1', or auto-round-nightly==0.17.0.dev20261026 with dpq installed "
            "--no-deps), or run without dpq (--parallel_quantization off)")


# -- several processes (dpq.planning.distributed, auto-round-dp under torchrun) ------------------

OFF_UNDER_TORCHRUN = ("--parallel_quantization off under torchrun (WORLD_SIZE > 1) would run the whole job once per "
                      "process, every process writing the same --output_dir. Fix: a world per process "
                      "(--parallel_quantization 1 for one lane each, or auto), or run without torchrun")

# A no-grad pass's reason to run on home alone (the format of refusals.home_alone): sample-ordered
# forwards run over the global lanes (dpq.sharded.shard_processes); these do not yet.
PASS_HOOKS_PROCESSES = (
    "several processes (torch.distributed) and this pass merges hook statistics (sums, maxima, ordered sinks), which "
    "have no canonical order across processes yet: every rank runs it on its own home device: this pass runs on home "
    "alone (same result, the same on every rank). Fix: none needed; one process with several lanes shards it")

TASKS_UNDER_TORCHRUN = ("--tasks under torchrun (WORLD_SIZE > 1) would run auto-round's evaluation once per process, "
                        "each on the same model. Fix: drop --tasks here and evaluate the saved model afterwards in one "
                        "process (auto-round --eval --model <output_dir> --tasks ...)")


_TIMEOUT_WHY = ("the process group's start waits that long for every rank, a collective for a lost one, and the host "
                "for an iteration's work")


def timeout_not_a_number(value: object, low: float = 10, high: float = 604800, caller: str = "cli") -> str:
    shown = repr(value) if caller == "cli" else value
    bounds = f"from {low:g} to {high:g}" if low else f"above 0, at most {high:g}"
    return (f"{_setting(caller, 'timeout', shown)} is not a number of seconds. Fix: a number {bounds}, "
            f"e.g. {_setting(caller, 'timeout', 600)} (the default)")


def timeout_out_of_range(value: object, low: float = 10, high: float = 604800, caller: str = "cli") -> str:
    """``low`` 0: any positive number up to ``high`` (one process, one block: dpq.parallel_tune)."""
    why = _TIMEOUT_WHY if low else "the host's wait for an iteration's work on the lanes"
    bounds = f"outside {low:g} to {high:g} seconds" if low else f"not more than 0 and at most {high:g} seconds"
    return (f"{_setting(caller, 'timeout', value)} is {bounds} ({why}). Fix: e.g. "
            f"{_setting(caller, 'timeout', 600)} (the default)")


def world_size_without_launcher(world_size: str, missing: Sequence[str]) -> str:
    """``WORLD_SIZE`` > 1 is set but the rest of a launcher's environment is not."""
    return (f"WORLD_SIZE={world_size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: this "
            "process was not started by torchrun (which sets them all), so it has no process group to join. Fix: unset "
            "WORLD_SIZE to run in one process, or launch the command with torchrun --nproc-per-node N -m "
            "dpq.autoround.cli ...")


def group_start_failed(backend: str, err: str) -> str:
    return (f"the {backend} process group did not start: {err}. Fix: start every rank with the same torchrun "
            "command (one rendezvous endpoint), check that the ranks can reach each other, or a longer "
            "--parallel_timeout when ranks start far apart")


def setting_differs(setting: str, each: str) -> str:
    """A line of :func:`jobs_differ`: ``each``, every rank's value, e.g. "rank 0: 4; rank 1: 5"."""
    return f"{setting} differs ({each})"


def jobs_differ(lines: Sequence[str]) -> str:
    """``lines``: :func:`setting_differs` for each setting the ranks were given differently."""
    return ("dpq: the ranks were given different jobs, so every rank stops before any work:\n"
            + "\n".join(f"  - {line}" for line in lines)
            + "\nFix: run every rank with the same command, model and data (only the devices, --output_dir and the "
            "paths to the same files may differ between ranks)")


def worlds_differ(each: str) -> str:
    """``each``: every rank's requested world, e.g. "rank 0: 2, rank 1: 'auto'"."""
    return f"the ranks asked for different worlds ({each}). Fix: the same --parallel_quantization on every rank"


def accelerator_shared(ranks: Sequence[int], device: str, host: str) -> str:
    return (f"ranks {', '.join(map(str, ranks))} all plan lanes on {device} of {host}: an accelerator belongs to one "
            "process. Fix: give each process its own devices (under torchrun: --parallel_devices cuda:$LOCAL_RANK, "
            "or one device list per process)")


def serial_every_rank(ranks: Sequence[int], why: str) -> str:
    """A note (the agreement's): the block runs serially on every rank."""
    return (f"serial on every rank: rank {', '.join(map(str, ranks))} cannot split this block ({why}). Fix: that "
            "rank's reason names its own fix")


def auto_fewest_lanes(lanes: int, ranks: Sequence[int]) -> str:
    """A note: under 'auto' every process runs the fewest lanes any rank has."""
    return (f"auto: every process runs {lanes} lane{'s' if lanes != 1 else ''}, the fewest any rank has "
            f"(rank {', '.join(map(str, ranks))}). Fix: the same fitting devices on every process, or an explicit "
            "--parallel_quantization N")


def auto_lanes_for_samples(lanes: int, samples: int) -> str:
    """A note: under 'auto' fewer lanes per process so that every lane gets a sample."""
    return (f"auto: {lanes} lane(s) per process so that every lane gets a sample ({samples} per iteration). Fix: a "
            "larger --batch_size for more lanes")


def rank_cancelled(rank: int, cause: str) -> str:
    return f"rank {rank} was cancelled ({cause})"


def rank_raised(rank: int, err: str) -> str:
    return f"the run failed on rank {rank}: {err}"


def rank_store_unreachable(rank: int) -> str:
    return (f"rank {rank} lost contact with another rank and could not reach the store to learn which (the rank "
            "hosting it may be gone)")


def ranks_drew_other_indices(ranks: Sequence[int]) -> str:
    return (f"process rank {', '.join(map(str, ranks))} drew other sample indices than rank 0 this iteration. Fix: "
            "every rank must draw the serial run's indices: the same sampler and seed on every rank, and no "
            "rank-dependent use of the random generators before the tune")


def ranks_silent(ranks: Sequence[int], grace_s: float) -> str:
    return f"rank {', '.join(map(str, ranks))} stopped answering (killed, or hung): no report within {grace_s:g} s"


def rank_reported_first(rank: int, err: str) -> str:
    return f"the run failed; rank {rank} reported first: {err}"


_RANK_FAILURE_FIX = {
    "raised": "the rank that raised printed its error with its traceback (in its own output, above); fix the cause "
              "and rerun the whole job",
    "silent": "find why the named rank stopped (its own output; a process killed for memory, a host gone), then rerun "
              "the whole job",
    "cancelled": "rerun the whole job when it should run",
    "lost": "each rank's own output says what it saw; fix the cause and rerun the whole job",
}


def rank_failure(head: str, rank: int, reports: Sequence[str], kind: str = "raised") -> str:
    """A multi-process run stopped (dpq.planning.distributed.RankFailure). ``head``: one of the texts above
    (:func:`rank_raised` ...), ``rank``: this rank, ``reports``: each rank's report, "rank N raised|lost|cancelled:
    ...", ``kind``: how it started (a key of ``_RANK_FAILURE_FIX``)."""
    return "\n".join([f"dpq: {head}",
                      f"every rank stops (no serial rerun across processes); this is rank {rank}, its home block "
                      "restored, and --output_dir is left as it was (a model is moved into place only once wholly "
                      f"saved). Fix: {_RANK_FAILURE_FIX[kind]}",
                      *(f"  {r}" for r in reports)])
