"""``hasten config`` (questionnaire), ``config default``, ``config update``, ``config explain``."""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
from pathlib import Path
from typing import Any, Optional, Union

from .config_schema import (
    DYNAMO_BACKENDS, DYNAMO_MODES, FSDP_PREFETCH, FSDP_SHARDING, FSDP_STATE_DICT, FSDP_WRAP, MIXED_PRECISION, SECTIONS,
    TOP, BadValue, coerce, default_config_path, normalize_gpu_ids, read_config, validate, write_config,
)
from .errors import HastenCLIError, did_you_mean
from .hardware import cuda_device_count
from .questions import Asker


def add_parser(subparsers: Any) -> None:
    from .launch_settings import add_launch_arguments

    p = subparsers.add_parser(
        "config", help="Answer a few questions and write the launch config file.",
        description="Ask how you train (machines, processes, precision, compile, FSDP/DeepSpeed) and write the "
                    "answers as YAML to --config_file (default: $HASTEN_CONFIG_FILE, else "
                    "~/.cache/hasten/default_config.yaml).",
    )
    p.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="Where to write the file.")
    p.set_defaults(func=questionnaire_command)
    sub = p.add_subparsers(dest="config_command", metavar="{default,update,explain}")
    d = sub.add_parser("default", help="Write a config for this machine without asking questions.")
    d.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="Where to write the file.")
    d.add_argument("--mixed_precision", "--mixed-precision", default="no", type=_precision, metavar="{no,fp16,bf16,fp8}")
    d.add_argument("--overwrite", action="store_true", help="Replace an existing file.")
    d.set_defaults(func=default_command)
    u = sub.add_parser("update", help="Rewrite a config (e.g. an old Accelerate one) in the current format, "
                                      "optionally changing keys: update num_processes=4 fsdp_config.fsdp_version=2.")
    u.add_argument("--config_file", "--config-file", default=None, metavar="PATH", help="The file to update.")
    u.add_argument("changes", nargs="*", metavar="key=value", help="Keys to change (sections as section.key).")
    u.set_defaults(func=update_command)
    e = sub.add_parser("explain", help="Print each effective launch setting and where it comes from.",
                       usage="hasten config explain [launch flags] [script.py [script args]]")
    add_launch_arguments(e, script=False)
    e.add_argument("training_script", nargs="?", default=None, metavar="script")
    e.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="...")
    e.set_defaults(func=explain_command)


def _precision(text: str) -> str:
    try:
        return coerce(TOP["mixed_precision"], text)
    except BadValue as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _path(args: argparse.Namespace) -> str:
    return os.path.expanduser(args.config_file) if args.config_file else default_config_path()


# ---------------------------------------------------------------------------------------------
def default_config(mixed_precision: str = "no") -> dict[str, Any]:
    """A config for this machine: every GPU in one process each, else one CPU process."""
    gpus = cuda_device_count()
    cfg: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mixed_precision,
                           "num_machines": 1, "machine_rank": 0}
    if gpus > 1:
        cfg.update(distributed_type="MULTI_GPU", num_processes=gpus, gpu_ids="all", use_cpu=False)
    elif gpus == 1:
        cfg.update(distributed_type="NO", num_processes=1, gpu_ids="all", use_cpu=False)
    else:
        cfg.update(distributed_type="NO", num_processes=1, use_cpu=True)
    return cfg


default_config_file = default_config_path()  # Accelerate's name for where `config default` writes


def write_basic_config(mixed_precision: str = "no", save_location: str = default_config_file) -> Union[Path, bool]:
    """Write the config that ``hasten config default`` writes, for use from Python (notebooks, tests).

    mixed_precision: "no", "fp16", "bf16" or "fp8". save_location: the file (default: the file
    ``hasten launch`` reads, ``$HASTEN_CONFIG_FILE`` else ``~/.cache/hasten/default_config.yaml``).
    Returns the path written, or ``False`` (with a message) when the file exists already: an
    existing config is never overwritten.
    """
    if save_location == default_config_file:  # left at the default: honour $HASTEN_CONFIG_FILE set since import
        save_location = default_config_path()
    path = Path(os.path.expanduser(os.fspath(save_location)))
    if path.exists():
        print(f"hasten: a configuration already exists at {path}; it was left unchanged. Run `hasten config` to "
              "change it, or pass another save_location.")
        return False
    choice = str(mixed_precision).lower()
    if choice not in MIXED_PRECISION:
        raise ValueError(f"write_basic_config(mixed_precision={mixed_precision!r}): use one of {list(MIXED_PRECISION)}")
    write_config(str(path), default_config(choice))
    return path


def default_command(args: argparse.Namespace) -> int:
    path = _path(args)
    if os.path.exists(path) and not args.overwrite:
        raise HastenCLIError(f"{path} already exists; pass --overwrite to replace it, or --config_file to write elsewhere")
    write_config(path, default_config(args.mixed_precision))
    print(f"hasten: default configuration written to {path}")
    return 0


def update_command(args: argparse.Namespace) -> int:
    path = _path(args)
    cfg = read_config(path)
    for change in args.changes:
        key, eq, value = change.partition("=")
        if not eq:
            raise HastenCLIError(f"{change!r} is not key=value; e.g. hasten config update num_processes=4")
        apply_change(cfg, key.strip(), value.strip())
    write_config(path, cfg)
    print(f"hasten: configuration updated at {path}")
    return 0


def apply_change(cfg: dict[str, Any], key: str, value: str) -> None:
    """``key=value`` from the command line (YAML value syntax; sections as ``section.key``)."""
    import yaml

    try:
        parsed = yaml.safe_load(value) if value else None
    except yaml.YAMLError:
        parsed = value
    section, dot, sub = key.partition(".")
    if dot:
        if section not in SECTIONS:
            hint = did_you_mean(section, list(SECTIONS))
            raise HastenCLIError(f"unknown config section {section!r}{hint or '; sections: ' + ', '.join(SECTIONS)}")
        cfg[section] = dict(cfg.get(section) or {}, **{sub: parsed})
    else:
        cfg[key] = parsed
    validate(cfg, f"hasten config update {key}={value}")


def explain_command(args: argparse.Namespace) -> int:
    from .launch import build_plan, explain

    print(explain(build_plan(args, need_script=False)))
    return 0


# ---------------------------------------------------------------------------------------------
def questionnaire_command(args: argparse.Namespace) -> int:
    path = _path(args)
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


def load_effective(path: Optional[str] = None) -> tuple[Optional[str], dict[str, Any]]:
    """The config ``hasten launch`` would read by default (path, content), for ``hasten env``."""
    path = path or default_config_path()
    if not os.path.isfile(path):
        return None, {}
    return path, read_config(path)
