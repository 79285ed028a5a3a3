"""The final DeepSpeed config of a run: "auto" values filled from the script, contradictions refused."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..utils.deepspeed import DummyOptim, DummyScheduler
from ..utils.deepspeed_plugin import AUTO, DeepSpeedPlugin, fill, get_path, set_path

_PRECISION = {"bf16": "bf16", "fp16": "fp16"}

# On CPU, DeepSpeed's default reduce bucket (5e8 elements) is a 1.9 GB fp32 buffer that gradients are
# copied through: every step touches as many of its pages as the model has gradients, so a process
# keeps a second full-size gradient copy resident. 1e7 elements (40 MB) keeps it small; DeepSpeed
# documents the setting as the bound on the memory used for reducing gradients. A smaller model gets a
# bucket of its own size.
CPU_REDUCE_BUCKET = 10_000_000

# What Accelerate writes for a gradient_clipping left "auto" (also the default DeepSpeedPlugin()'s).
AUTO_CLIPPING = 1.0


def _leftover_autos(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, v in node.items() for k in _leftover_autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if node == AUTO else []


def _micro_batch(dataloaders: list[Any], world: int) -> Optional[int]:
    for dl in dataloaders:
        total = getattr(dl, "total_batch_size", None)
        if isinstance(total, int) and total > 0:
            return max(1, total // world)
        size = getattr(dl, "batch_size", None)
        if isinstance(size, int):
            return size
    return None


def _torch_optimizer(section: dict, dummy: DummyOptim) -> torch.optim.Optimizer:
    """The torch optimizer equal to the config's ``optimizer`` section (DeepSpeed's would compile ops)."""
    kind = str(section.get("type", "")).lower()
    params = dict(section.get("params", {}))
    if params.get("lr", AUTO) == AUTO:
        params["lr"] = dummy.lr
    if params.get("weight_decay", AUTO) == AUTO:
        params["weight_decay"] = dummy.weight_decay
    for key in ("betas", "eps"):
        if params.get(key) == AUTO:
            params.pop(key)
    section["params"] = params
    adam_w = params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
        cls = torch.optim.AdamW if adam_w or kind == "adamw" else torch.optim.Adam
        return cls(dummy.params, **params)
    if kind == "sgd":
        return torch.optim.SGD(dummy.params, **params)
    raise ValueError(f"optimizer type {section.get('type')!r} of the DeepSpeed config has no torch equivalent here; "
                     "use Adam, AdamW or SGD, or build the optimizer in the script and remove the section")


def _fill_scheduler(section: dict, sched: DummyScheduler, lr: float) -> None:
    params = section.setdefault("params", {})
    values = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": sched.warmup_num_steps,
              "total_num_steps": sched.total_num_steps, "cos_min_ratio": 0.0001}
    for key, value in params.items():
        if value == AUTO:
            if values.get(key) is None:
                raise ValueError(f"scheduler.params.{key} is \"auto\" but DummyScheduler was not given it; pass "
                                 f"DummyScheduler(..., {key}=...) or write the value in the DeepSpeed config")
            params[key] = values[key]


def _bucket_sizes(config: dict, model: nn.Module) -> None:
    """transformers' rules for ZeRO bucket sizes written "auto" (from the model's hidden size)."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    rules = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
             "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
    for key, rule in rules.items():
        if get_path(config, key) == AUTO:
            if hidden is None:
                raise ValueError(f"{key} is \"auto\" but the model has no config.hidden_size to derive it from; write "
                                 "a number in the DeepSpeed config")
            set_path(config, key, rule(int(hidden)))


def agree_accumulation(plugin: DeepSpeedPlugin, steps: int, explicit: bool) -> int:
    """The run's accumulation steps, agreed between the Accelerator (``steps``; ``explicit`` when the
    script set them) and the DeepSpeed config: the config's number when only it sets one; otherwise
    the Accelerator's, written into the config where it says "auto" (or a launcher's default)."""
    config = plugin.deepspeed_config
    current = get_path(config, "gradient_accumulation_steps")
    if current not in (None, AUTO) and not explicit:
        return int(current)
    if explicit and "gradient_accumulation_steps" in plugin.soft_fields:
        config["gradient_accumulation_steps"] = AUTO  # from the launcher: the script's value wins
    fill(config, "gradient_accumulation_steps", steps, "Accelerator(gradient_accumulation_steps=...)",
         getattr(plugin, "config_source", "the DeepSpeed config"))
    return steps


def resolve_config(plugin: DeepSpeedPlugin, state: Any, call: Any, model: nn.Module, opt: Any,
                   sched: Any, data_parallel: Optional[int] = None
                   ) -> tuple[dict, Optional[torch.optim.Optimizer], Optional[Callable]]:
    """(config for ``deepspeed.initialize``, the torch optimizer to pass, a scheduler builder or None).
    ``opt`` None: the config of an engine without optimizer (a model prepared for inference).

    ``state``: the process state; ``call``: the ``prepared.PrepareCall`` (prepared dataloaders, accumulation steps)."""
    config = copy.deepcopy(plugin.deepspeed_config)
    where = getattr(plugin, "config_source", "the DeepSpeed config")
    world = data_parallel or state.num_processes  # sp processes share one batch (Accelerate's rule too)
    steps = call.accumulation_steps
    fill(config, "gradient_accumulation_steps", steps, f"the Accelerator's gradient_accumulation_steps", where)
    micro = _micro_batch(call.dataloaders, world)
    if opt is None and micro is None and get_path(config, "train_micro_batch_size_per_gpu") in (None, AUTO):
        micro = 1  # an engine without optimizer (inference) never steps: its batch size means nothing
    if get_path(config, "train_micro_batch_size_per_gpu") in (None, AUTO):
        if micro is None:
            train = get_path(config, "train_batch_size")
            if train in (None, AUTO):
                raise ValueError("train_micro_batch_size_per_gpu is \"auto\" but no dataloader was prepared to take it "
                                 "from; prepare the dataloader in the same prepare() call as the model, or write the "
                                 "number in the DeepSpeed config")
            micro = int(train) // (steps * world)
        set_path(config, "train_micro_batch_size_per_gpu", micro)
    elif micro is not None:
        fill(config, "train_micro_batch_size_per_gpu", micro, "the prepared dataloader's batch size per process",
             where)
    fill(config, "train_batch_size", int(get_path(config, "train_micro_batch_size_per_gpu")) * steps * world,
         "micro-batch x accumulation x processes", where)
    clipping = get_path(config, "gradient_clipping")
    if clipping == AUTO:
        # Accelerate's rule: "auto" is the plugin's gradient_clipping, else 1.0 (hasten's plugin has
        # already written its own value over an "auto" of the JSON, so what is left means 1.0). A
        # clip_grad_norm_(max_norm) call of a step still clips that step at max_norm.
        set_path(config, "gradient_clipping", AUTO_CLIPPING)
    elif clipping is None:
        set_path(config, "gradient_clipping", 0.0)  # absent: off, DeepSpeed's own default differs by version
    mode = state.mixed_precision
    for name in ("bf16", "fp16"):
        enabled = get_path(config, f"{name}.enabled")
        wanted = mode == name
        if enabled == AUTO or (enabled is None and wanted):
            set_path(config, f"{name}.enabled", wanted)
        elif bool(enabled) != wanted:
            raise ValueError(f"{where} sets {name}.enabled={enabled} but mixed_precision={mode!r}; make them agree "
                             f"(mixed_precision={name!r} / --mixed_precision {name}, or \"enabled\": \"auto\")")
    config.setdefault("zero_allow_untested_optimizer", True)  # a torch optimizer is the normal case here
    config.setdefault("zero_force_ds_cpu_optimizer", False)
    config["steps_per_print"] = 2 ** 62
    _bucket_sizes(config, model)
    if state.device.type == "cpu" and isinstance(config.get("zero_optimization"), dict):
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        config["zero_optimization"].setdefault("reduce_bucket_size", max(1, min(CPU_REDUCE_BUCKET, numel)))

    section = config.pop("optimizer", None)
    if opt is None:  # a model prepared alone: an engine for inference, the config's optimizer is not built
        config.pop("scheduler", None)
        left = _leftover_autos(config)
        if left:
            raise ValueError(f"{where}: no value for \"auto\" at {', '.join(left)}; write numbers there")
        return config, None, None
    if isinstance(opt, DummyOptim):
        if section is None:
            raise ValueError(f"prepare() got DummyOptim but {where} has no \"optimizer\" section; add one, or pass a "
                             "real torch optimizer")
        torch_opt = _torch_optimizer(section, opt)
    else:
        if section is not None:
            raise ValueError(f"{where} defines an \"optimizer\" section and the script passes "
                             f"{type(opt).__name__}; remove the section, or pass DummyOptim(model.parameters(), lr=...)")
        torch_opt = opt
    lr = torch_opt.param_groups[0]["lr"]
    build = None
    sched_section = config.get("scheduler")
    if isinstance(sched, DummyScheduler):
        if sched_section is not None:
            _fill_scheduler(sched_section, sched, lr)
        elif sched.lr_scheduler_callable is not None:
            build = sched.lr_scheduler_callable
        else:
            raise ValueError(f"prepare() got DummyScheduler but {where} has no \"scheduler\" section; add one, or pass "
                             "DummyScheduler(..., lr_scheduler_callable=...) or a torch scheduler")
    elif sched_section is not None:
        raise ValueError(f"{where} defines a \"scheduler\" section and the script "
                         + (f"passes {type(sched).__name__}" if sched is not None else "passes no DummyScheduler")
                         + "; remove the section, or pass DummyScheduler(optimizer, ...)")
    left = _leftover_autos(config)
    if left:
        raise ValueError(f"{where}: no value for \"auto\" at {', '.join(left)}; write numbers there")
    return config, torch_opt, build
