"""``hasten launch --use_megatron_lm`` (Accelerate's Megatron-LM launch) run on the native layout. Torch-free.

Accelerate's flags (``--megatron_lm_tp_degree``, ``--megatron_lm_pp_degree``, ``--megatron_lm_num_micro_batches``,
...), its variables (``ACCELERATE_USE_MEGATRON_LM``, ``MEGATRON_LM_TP_DEGREE``, ...) and a config file with
``distributed_type: MEGATRON_LM`` and a ``megatron_lm_config`` section are read as Accelerate reads them, then
mapped onto the ``parallelism_config`` settings (tp_size, pp_size, pp_microbatches) exactly as
``Accelerator(megatron_lm_plugin=...)`` maps a ``MegatronLMPlugin`` (``utils.megatron_lm``): the launcher's
layout check, ``--dry_run`` and the processes' ``PARALLELISM_CONFIG_*`` variables then hold the native layout.
The processes also get the ``MEGATRON_LM_*`` variables, so a script that builds ``MegatronLMPlugin()`` itself
reads the same degrees. What only Megatron's engine does (sequence parallelism, activation recomputation,
the distributed optimizer) is refused here, in one line, before any process starts; other keys of
``megatron_lm_config`` (learning-rate schedule, ...) belong to Megatron's train step and are named in the
one warning as not applied.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..utils.megatron_lm import LAUNCHER_WARNED, mapping_message, refusal
from .errors import HastenCLIError
from .launch_settings import CONFIG, DEFAULT, Resolved

_FLAGS = ("megatron_lm_tp_degree", "megatron_lm_pp_degree", "megatron_lm_num_micro_batches",
          "megatron_lm_sequence_parallelism", "megatron_lm_recompute_activations",
          "megatron_lm_use_distributed_optimizer", "megatron_lm_gradient_clipping")
_REFUSED = ("sequence_parallelism", "recompute_activations", "use_distributed_optimizer")
# megatron setting -> the parallelism_config setting it becomes
_MAPPED = {"megatron_lm_tp_degree": "parallelism_config_tp_size", "megatron_lm_pp_degree": "parallelism_config_pp_size",
           "megatron_lm_num_micro_batches": "parallelism_config_pp_microbatches"}


def _src(res: Resolved, name: str) -> str:
    return res.values[name].source


def apply_megatron(res: Resolved, cfg: Mapping[str, Any], label: str, procs: int) -> tuple[dict[str, str], list[str]]:
    """Map the Megatron-LM settings onto ``res``'s parallelism settings; returns the processes' extra
    ``MEGATRON_LM_*`` variables and the warnings to print (none when Megatron-LM is not asked for).

    As in Megatron, the processes left over by tp x pp (x cp) are data-parallel: unless the layout names
    its data-parallel sizes, ``dp_replicate_size`` becomes ``procs // (tp x pp x cp)`` (DDP over replicas
    of the model, which is what pipeline parallelism composes with)."""
    if cfg.get("distributed_type") == "MEGATRON_LM" and res.values["use_megatron_lm"].rank == DEFAULT:
        res.set("use_megatron_lm", True, f"{label}: distributed_type MEGATRON_LM", CONFIG)
    if not res["use_megatron_lm"]:
        return {}, []
    for key in _REFUSED:
        name = f"megatron_lm_{key}"
        if res[name]:
            raise HastenCLIError(f"{name}=true ({_src(res, name)}): {refusal(key)}")
    tp, pp = res["megatron_lm_tp_degree"] or 1, res["megatron_lm_pp_degree"] or 1
    micro = res["megatron_lm_num_micro_batches"]
    if pp == 1 and micro and micro > 1:
        raise HastenCLIError(f"megatron_lm_num_micro_batches={micro} ({_src(res, 'megatron_lm_num_micro_batches')}) "
                             "without a pipeline (megatron_lm_pp_degree 1) is gradient accumulation; use "
                             f"--gradient_accumulation_steps {micro} and drop megatron_lm_num_micro_batches")
    wanted = {"megatron_lm_tp_degree": tp, "megatron_lm_pp_degree": pp,
              "megatron_lm_num_micro_batches": micro if pp > 1 else None}
    for name, target in _MAPPED.items():
        value, native = wanted[name], res.values[target]
        if value is None:
            continue
        if native.rank > DEFAULT and native.value is not None and native.value != value:
            raise HastenCLIError(f"{name} {value} ({_src(res, name)}) and {target.replace('parallelism_config_', '')} "
                                 f"{native.value} ({native.source}) disagree; give the layout once (the "
                                 "parallelism_config settings are hasten's own; drop the Megatron-LM one)")
        if native.rank == DEFAULT or native.value is None:
            res.set(target, value, f"{_src(res, name)} (Megatron-LM, mapped)", res.values[name].rank or CONFIG)
    if (tp > 1 or pp > 1) and not res["use_parallelism_config"]:
        res.set("use_parallelism_config", True, f"{_src(res, 'use_megatron_lm')} (Megatron-LM, mapped)",
                res.values["use_megatron_lm"].rank)
    cp = res["parallelism_config_cp_size"] or 1
    model = tp * pp * cp
    dp = res.values["parallelism_config_dp_replicate_size"]
    untouched = dp.rank == DEFAULT and res.values["parallelism_config_dp_shard_size"].rank == DEFAULT
    if untouched and model > 1 and procs > model and procs % model == 0:
        res.set("parallelism_config_dp_replicate_size", procs // model,
                f"{procs} processes / (tp {tp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "") +
                ") (Megatron-LM: the other processes are data-parallel)", CONFIG)
    known = set(_FLAGS)
    unused = sorted(k for k, v in (cfg.get("megatron_lm_config") or {}).items()
                    if k not in known and v not in (None, False, "", [], {}))
    if res["megatron_lm_gradient_clipping"] not in (None, 1.0, 0.0):
        unused.insert(0, "megatron_lm_gradient_clipping (call accelerator.clip_grad_norm_)")
    schedule = res["parallelism_config_pp_schedule"] or "1F1B"
    micro_shown = res["parallelism_config_pp_microbatches"] if pp > 1 else None
    if pp > 1 and micro_shown is None:
        micro_shown = pp * (res["parallelism_config_pp_stages_per_rank"] or 1)
    warning = "hasten: warning: " + mapping_message(tp, pp, cp, micro_shown, schedule, unused,
                                                    res["parallelism_config_dp_replicate_size"] or 1)
    env = {"MEGATRON_LM_TP_DEGREE": str(tp), "MEGATRON_LM_PP_DEGREE": str(pp), LAUNCHER_WARNED: "1"}
    if micro:
        env["MEGATRON_LM_NUM_MICRO_BATCHES"] = str(micro)
    return env, [warning]
