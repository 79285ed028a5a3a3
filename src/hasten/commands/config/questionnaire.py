"""``hasten config``: the questionnaire that writes the launch config file."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
from typing import Any

from ..config_schema import (
    DYNAMO_BACKENDS, DYNAMO_MODES, FSDP_PREFETCH, FSDP_SHARDING, FSDP_STATE_DICT, FSDP_WRAP, MIXED_PRECISION, BadValue,
    default_config_path, normalize_gpu_ids, write_config,
)
from ..hardware import cuda_device_count
from ..questions import Asker
from .paths import config_path_of


def questionnaire_command(args: argparse.Namespace) -> int:
    path = config_path_of(args)
    cfg = ask_config(Asker())
    write_config(path, cfg)
    print(f"hasten: configuration written to {path}")
    default = os.path.abspath(default_config_path()) == os.path.abspath(path)
    print("hasten: start training with: hasten launch "
          + ("" if default else f"--config_file {shlex.quote(path)} ") + "your_script.py")
    return 0


_MACHINE_TYPES = [
    ("NO", "no distributed training (one process)"),
    ("MULTI_CPU", "multi-CPU (several processes on CPU)"),
    ("MULTI_GPU", "multi-GPU (one process per GPU)"),
    ("MULTI_XPU", "multi-XPU (Intel GPUs)"),
]  # no TPU: hasten launch refuses distributed_type XLA, so the questionnaire does not offer it


def _host(text: str) -> str:
    text = text.strip()
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        if re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", text):
            return text
    raise BadValue(f"{text!r} is not an IP address or host name")


def _gpu_ids(text: str) -> str:
    return normalize_gpu_ids(text)


def ask_config(ask: Asker) -> dict[str, Any]:
    """The questionnaire; returns a config mapping (validated when written)."""
    gpus = cuda_device_count()
    cfg: dict[str, Any] = {}
    cfg["compute_environment"] = ask.choice(
        "In which compute environment are you running?",
        [("LOCAL_MACHINE", "this machine, or a cluster of machines I start myself"),
         ("AMAZON_SAGEMAKER", "Amazon SageMaker")],
        "LOCAL_MACHINE",
        refuse={"AMAZON_SAGEMAKER": "hasten does not submit SageMaker jobs; choose 1 and run hasten launch inside the job"},
    )
    dtype = ask.choice("Which kind of machine?", _MACHINE_TYPES, "MULTI_GPU" if gpus > 1 else "NO")
    cfg["distributed_type"] = dtype
    machines = 1
    if dtype != "NO":
        machines = ask.number("How many machines will take part?", 1, minimum=1)
    cfg["num_machines"] = machines
    cfg["machine_rank"] = 0
    if machines > 1:
        cfg["machine_rank"] = ask.number(f"Rank of this machine (0 to {machines - 1})?", 0, minimum=0,
                                         maximum=machines - 1)
        cfg["main_process_ip"] = ask.text("IP address (or host name) of machine 0?", None, _host)
        cfg["main_process_port"] = ask.number("Port on machine 0?", 29500, kind="port", minimum=1)
        cfg["rdzv_backend"] = ask.choice(
            "Rendezvous backend?", [("static", "static (fixed machine ranks)"), ("c10d", "c10d (ranks assigned on join)")],
            "static")
        cfg["same_network"] = ask.yes_no("Are all machines on the same local network?", True)
    if dtype == "NO":
        cfg["num_processes"] = 1
        cfg["use_cpu"] = ask.yes_no("Run on CPU only, even if a GPU is present?", gpus == 0)
    else:
        per_default = gpus if dtype == "MULTI_GPU" and gpus else 2
        cfg["num_processes"] = ask.number(
            "How many processes in total (all machines together)?", per_default * machines, minimum=1,
            check=lambda n: None if n % machines == 0 else f"{n} is not a multiple of the {machines} machines",
        )
        cfg["use_cpu"] = dtype == "MULTI_CPU"
    per_node = cfg["num_processes"] // machines
    if dtype == "MULTI_GPU":
        cfg["gpu_ids"] = ask.text(
            "Which GPUs of this machine (ids such as 0,1, or all)?", "all",
            lambda t: _check_ids(_gpu_ids(t), per_node),
        )
    if ask.yes_no("Compile the model with torch.compile?", False):
        backends = [b for b in DYNAMO_BACKENDS if b != "NO"]
        dyn = {"dynamo_backend": ask.choice("Which backend?", [(b, b.lower()) for b in backends], "INDUCTOR")}
        dyn["dynamo_mode"] = ask.choice("Which mode?", [(m, m) for m in DYNAMO_MODES], "default")
        dyn["dynamo_use_fullgraph"] = ask.yes_no("Require a single graph (fullgraph)?", False)
        dyn["dynamo_use_dynamic"] = ask.yes_no("Trace dynamic shapes?", False)
        cfg["dynamo_config"] = dyn
    if dtype in ("MULTI_GPU", "MULTI_XPU", "MULTI_CPU"):  # DeepSpeed and FSDP2 train on CPU processes too
        if ask.yes_no("Use DeepSpeed?", False):
            cfg["distributed_type"] = "DEEPSPEED"
            cfg["deepspeed_config"] = _ask_deepspeed(ask)
        elif ask.yes_no("Use FSDP (fully sharded data parallel)?", False):
            cfg["distributed_type"] = "FSDP"
            cfg["fsdp_config"] = _ask_fsdp(ask)
    steps = ask.number("Gradient accumulation steps (micro-batches per optimizer step)?", 1, minimum=1)
    if cfg["distributed_type"] == "DEEPSPEED":
        cfg["deepspeed_config"]["gradient_accumulation_steps"] = steps
    else:
        cfg["gradient_accumulation_steps"] = steps
    cfg["mixed_precision"] = ask.choice("Mixed precision?", [(p, p) for p in MIXED_PRECISION], "no")
    if cfg["mixed_precision"] == "fp8":
        cfg["fp8_config"] = _ask_fp8(ask, fsdp=cfg["distributed_type"] == "FSDP")
    return cfg


def _ask_fp8(ask: Asker, fsdp: bool) -> dict[str, Any]:
    backends = [("AO", "torchao (works on CPU and on GPUs with compute capability 8.9+)"),
                ("TE", "NVIDIA Transformer Engine"), ("MSAMP", "MS-AMP")]
    fp8: dict[str, Any] = {"backend": ask.choice("Which fp8 backend?", backends, "AO")}
    if fp8["backend"] == "AO":
        fp8["pad_inner_dim"] = ask.yes_no("Pad matmul dimensions to multiples of 16 (pad_inner_dim)?", True)
        if fsdp:
            fp8["enable_fsdp_float8_all_gather"] = ask.yes_no("All-gather FSDP shards in float8?", True)
    elif fp8["backend"] == "TE":
        fp8["fp8_format"] = ask.choice("fp8 format?", [(f, f) for f in ("HYBRID", "E4M3", "E5M2")], "HYBRID")
        fp8["amax_history_len"] = ask.number("Amax history length?", 1024, minimum=1)
        fp8["amax_compute_algo"] = ask.choice("Amax algorithm?", [(a, a) for a in ("max", "most_recent")],
                                              "most_recent")
    else:
        fp8["opt_level"] = ask.choice("MS-AMP optimisation level?", [("O1", "O1"), ("O2", "O2")], "O2")
    return fp8


def _check_ids(ids: str, per_node: int) -> str:
    if ids != "all" and len(ids.split(",")) != per_node:
        raise BadValue(f"{ids} lists {len(ids.split(','))} GPU(s) but there are {per_node} process(es) per machine")
    return ids


def _ask_deepspeed(ask: Asker) -> dict[str, Any]:
    ds: dict[str, Any] = {}

    def existing(path: str) -> str:
        if not os.path.isfile(os.path.expanduser(path)):
            raise BadValue(f"{path} does not exist")
        return path

    if ask.yes_no("Do you have a DeepSpeed JSON config file?", False):
        ds["deepspeed_config_file"] = ask.text("Path of the DeepSpeed JSON file?", None, existing)
        return ds
    stage = ask.choice("ZeRO stage?", [(0, "0 (off)"), (1, "1 (optimizer states)"), (2, "2 (+ gradients)"),
                                        (3, "3 (+ parameters)")], 2)
    ds["zero_stage"] = stage
    devices = [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")]
    ds["offload_optimizer_device"] = ask.choice("Offload optimizer states to?", devices, "none")
    if ds["offload_optimizer_device"] == "nvme":
        ds["offload_optimizer_nvme_path"] = ask.text("NVMe folder for the optimizer states?", "/nvme")
    if stage == 3:
        ds["offload_param_device"] = ask.choice("Offload parameters to?", devices, "none")
        if ds["offload_param_device"] == "nvme":
            ds["offload_param_nvme_path"] = ask.text("NVMe folder for the parameters?", "/nvme")
        ds["zero3_init_flag"] = ask.yes_no("Create large models directly sharded (zero3_init_flag)?", True)
        ds["zero3_save_16bit_model"] = ask.yes_no("Save a 16-bit model at the end (zero3_save_16bit_model)?", True)
    ds["gradient_clipping"] = ask.number("Gradient clipping (max norm)?", 1.0, kind="float", minimum=0)
    return ds


def _ask_fsdp(ask: Asker) -> dict[str, Any]:
    f: dict[str, Any] = {"fsdp_version": ask.choice("FSDP version?", [(2, "2 (per-parameter sharding, recommended)"),
                                                                      (1, "1")], 2)}
    if f["fsdp_version"] == 1:
        f["fsdp_sharding_strategy"] = ask.choice("Sharding strategy?", [(s, s) for s in FSDP_SHARDING], "FULL_SHARD")
        f["fsdp_backward_prefetch"] = ask.choice("Backward prefetch?", [(s, s) for s in FSDP_PREFETCH], "BACKWARD_PRE")
        f["fsdp_forward_prefetch"] = ask.yes_no("Forward prefetch?", False)
        f["fsdp_use_orig_params"] = ask.yes_no("Keep the original parameters (use_orig_params)?", True)
    else:
        f["fsdp_reshard_after_forward"] = "true" if ask.yes_no("Reshard parameters after forward?", True) else "false"
    f["fsdp_offload_params"] = ask.yes_no("Offload parameters and gradients to CPU?", False)
    f["fsdp_auto_wrap_policy"] = ask.choice("How to split the model into shards?", [(w, w) for w in FSDP_WRAP],
                                            "TRANSFORMER_BASED_WRAP")
    if f["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        names = ask.text("Layer classes to wrap, comma-separated (empty: read from the model)?", None, allow_empty=True)
        if names:
            f["fsdp_transformer_layer_cls_to_wrap"] = names
    elif f["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP":
        f["fsdp_min_num_params"] = ask.number("Minimum parameters per shard?", 100_000_000, minimum=1)
    f["fsdp_state_dict_type"] = ask.choice("Checkpoint format?", [(s, s) for s in FSDP_STATE_DICT], "SHARDED_STATE_DICT")
    f["fsdp_cpu_ram_efficient_loading"] = ask.yes_no("Load pretrained weights on rank 0 only (saves CPU RAM)?", True)
    f["fsdp_sync_module_states"] = True if f["fsdp_cpu_ram_efficient_loading"] else ask.yes_no(
        "Broadcast rank 0's weights at start (sync_module_states)?", True)
    f["fsdp_activation_checkpointing"] = ask.yes_no("Activation checkpointing?", False)
    return f
