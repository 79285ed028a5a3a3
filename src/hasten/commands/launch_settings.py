"""Every ``hasten launch`` setting in one table: its flag, config key, environment names, type.

The effective value of a setting is the command-line flag, else the environment, else the config
file, else the default; ``resolve`` returns each value with where it came from, so that
``--dry_run`` and ``hasten config explain`` can show it. Torch-free.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..layout import AXIS_TABLE
from ..topology import DEFAULT_PORT, slurm_master_addr, slurm_port
from ..utils.environment import env_names
from .config_schema import SECTIONS, TOP, BadValue, Key, coerce
from .errors import HastenCLIError

# Source ranks: a higher rank wins; equal ranks that contradict each other are an error.
FLAG, ENV, CONFIG, DEFAULT = 3, 2, 1, 0


@dataclass(frozen=True)
class Setting:
    """One launch setting. ``config`` is its path in the config file (None: flag only)."""

    name: str
    key: Key
    group: str
    help: str
    flags: tuple[str, ...] = ()
    store_true: bool = False
    config: Optional[tuple[str, ...]] = None
    env: tuple[str, ...] = ()
    child_env: Optional[str] = None
    hidden: bool = False


def _switch(name: str, group: str, help: str) -> Setting:
    """The boolean flag that turns a group on (``--use_fsdp``), read from HASTEN_/ACCELERATE_ variables."""
    return _s(name, group, help, kind="bool", default=False, store_true=True, config=None,
              env=env_names(name.upper()), child_env=f"HASTEN_{name.upper()}")


def _section(switch: Setting, section: str, helps: Mapping[str, str], env_of: Any, skip: tuple = (),
             hidden: tuple = ()) -> list[Setting]:
    """The switch, then one setting per key of config ``section``; ``env_of(key)``: its variable (or None)."""
    return [switch] + [
        _s(name, switch.group, helps.get(name, ""), config=(section, name), env=(env_of(name),) if env_of(name) else (),
           child_env=env_of(name), hidden=name in hidden)
        for name in SECTIONS[section] if name not in skip]


def _key_at(path: tuple[str, ...]) -> Key:
    return TOP[path[0]] if len(path) == 1 else SECTIONS[path[0]][path[1]]


def _s(name: str, group: str, help: str, *, kind: Optional[str] = None, config: Any = "top", env: Any = "hasten",
       child_env: Optional[str] = None, flags: tuple[str, ...] = (), store_true: bool = False, default: Any = None,
       choices: tuple = (), minimum: Optional[float] = None, hidden: bool = False) -> Setting:
    path = (name,) if config == "top" else config
    if kind is None:
        key = _key_at(path)
    else:
        key = Key(name, kind, default, choices, minimum)
    if env == "hasten":
        env = (f"HASTEN_{name.upper()}", f"ACCELERATE_{name.upper()}")
    flags = flags or (f"--{name}",)
    return Setting(name, key, group, help, flags, store_true, path, tuple(env or ()), child_env, hidden)


G_RES, G_TRAIN, G_PROC, G_FSDP, G_DS, G_PAR = (
    "Resources", "Training settings (passed to every process)", "Process management", "FSDP (passed to the processes)",
    "DeepSpeed (passed to the processes)", "N-D parallelism (passed to the processes)",
)

_CORE = [
    _s("use_cpu", G_RES, "Run on CPU even if GPUs are present.", flags=("--cpu",), store_true=True,
       env=env_names("USE_CPU"), child_env="HASTEN_USE_CPU"),
    _s("multi_gpu", G_RES, "Run one process per GPU (distributed data parallel).", kind="bool", default=False,
       store_true=True, config=None, env=()),
    # At least 1 here; only a config file may say -1 (Accelerate's "not set"), handled when it is read.
    _s("num_processes", G_RES, "Processes in total, over all machines (default: one per GPU, else 1).", kind="int",
       minimum=1),
    _s("num_machines", G_RES, "Machines taking part (default 1; read from SLURM/MPI when launched by srun/mpirun)."),
    _s("machine_rank", G_RES, "Index of this machine, from 0 (static rendezvous)."),
    _s("main_process_ip", G_RES, "Address of machine 0 (default 127.0.0.1 on one machine).",
       env=("HASTEN_MAIN_PROCESS_IP", "ACCELERATE_MAIN_PROCESS_IP", "MASTER_ADDR")),
    _s("main_process_port", G_RES, "Port of machine 0; 0 picks a free port (default: free port on one machine, "
       f"{DEFAULT_PORT} on several).", env=("HASTEN_MAIN_PROCESS_PORT", "ACCELERATE_MAIN_PROCESS_PORT", "MASTER_PORT")),
    _s("gpu_ids", G_RES, "GPUs to use on this machine: all, or ids such as 0,1."),
    _s("num_cpu_threads_per_process", G_RES, "OMP_NUM_THREADS of each process (default: CPU cores / processes "
       "on CPU, 1 with GPUs).", env=("HASTEN_NUM_CPU_THREADS_PER_PROCESS", "OMP_NUM_THREADS"),
       child_env="OMP_NUM_THREADS"),
    _s("same_network", G_RES, "All machines are on the same network (stored for compatibility).", store_true=True,
       env=()),
    _s("mixed_precision", G_TRAIN, "no, fp16, bf16 or fp8.", env=env_names("MIXED_PRECISION"),
       child_env="HASTEN_MIXED_PRECISION"),
    _s("gradient_accumulation_steps", G_TRAIN, "Micro-steps per optimizer step.",
       env=env_names("GRADIENT_ACCUMULATION_STEPS"), child_env="HASTEN_GRADIENT_ACCUMULATION_STEPS"),
    _s("dynamo_backend", G_TRAIN, "torch.compile backend (no, inductor, eager, aot_eager, cudagraphs, ...).",
       config=("dynamo_config", "dynamo_backend"), env=env_names("DYNAMO_BACKEND"), child_env="HASTEN_DYNAMO_BACKEND"),
    _s("dynamo_mode", G_TRAIN, "torch.compile mode: default, reduce-overhead, max-autotune.",
       config=("dynamo_config", "dynamo_mode"), env=env_names("DYNAMO_MODE"), child_env="HASTEN_DYNAMO_MODE"),
    _s("dynamo_use_fullgraph", G_TRAIN, "torch.compile(fullgraph=True).", store_true=True,
       config=("dynamo_config", "dynamo_use_fullgraph"), env=env_names("DYNAMO_USE_FULLGRAPH"),
       child_env="HASTEN_DYNAMO_USE_FULLGRAPH"),
    _s("dynamo_use_dynamic", G_TRAIN, "torch.compile(dynamic=True).", store_true=True,
       config=("dynamo_config", "dynamo_use_dynamic"), env=env_names("DYNAMO_USE_DYNAMIC"),
       child_env="HASTEN_DYNAMO_USE_DYNAMIC"),
    _s("dynamo_use_regional_compilation", G_TRAIN, "Compile repeated blocks once.", store_true=True,
       config=("dynamo_config", "dynamo_use_regional_compilation"), env=env_names("DYNAMO_USE_REGIONAL_COMPILATION"),
       child_env="HASTEN_DYNAMO_USE_REGIONAL_COMPILATION"),
    _s("debug", G_TRAIN, "Check collectives for mismatched shapes (slower); verbose launcher logs.",
       store_true=True, env=env_names("DEBUG"), child_env="HASTEN_DEBUG"),
    _s("rdzv_backend", G_PROC, "Rendezvous: static (default), c10d, etcd, etcd-v2."),
    _s("rdzv_conf", G_PROC, "Extra rendezvous settings, key=value,key2=value2.", kind="str", config=None),
    _s("max_restarts", G_PROC, "Restart the whole group up to N times after a failure.", kind="int", default=0,
       minimum=0, config=None),
    _s("monitor_interval", G_PROC, "Seconds between checks of the processes.", kind="float", default=0.1,
       minimum=0.001, config=None),
    _s("tee", G_PROC, "Copy output to files in --log_dir as well: 0 none, 1 stdout, 2 stderr, 3 both "
       "(or per rank: 0:3,1:1).", kind="str", config=None, flags=("--tee", "-t")),
    _s("log_dir", G_PROC, "Folder for the per-process log files.", kind="str", config=None),
    _s("hang_timeout", G_PROC, "Seconds without progress after which the processes' stacks are dumped, a "
       "report names where each rank is, and the job stops with exit status 124 (default 300; 0: off).",
       env=("HASTEN_HANG_TIMEOUT",)),
]

_FSDP_ENV = {"fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP"}
_HELP = {
    "fsdp_version": "1 or 2.", "fsdp_sharding_strategy": "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD(_ZERO2).",
    "fsdp_reshard_after_forward": "true/false (FSDP2) or a sharding strategy (FSDP1).",
    "fsdp_offload_params": "true/false: keep parameters on CPU.", "fsdp_min_num_params": "Parameters per shard "
    "(SIZE_BASED_WRAP).", "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP.",
    "fsdp_transformer_layer_cls_to_wrap": "Layer class names, comma-separated.",
    "fsdp_backward_prefetch": "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH.",
    "fsdp_state_dict_type": "FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT.",
    "fsdp_forward_prefetch": "true/false.", "fsdp_use_orig_params": "true/false.",
    "fsdp_cpu_ram_efficient_loading": "true/false: load weights on rank 0 only.",
    "fsdp_sync_module_states": "true/false: broadcast rank 0's weights.",
    "fsdp_activation_checkpointing": "true/false.", "fsdp_activation_checkpointing_offload": "true/false.",
    "fsdp_ignored_modules": "Modules left unsharded: a regex of module names.",
    "deepspeed_config_file": "A DeepSpeed JSON file (the other DeepSpeed flags then come from it).",
    "zero_stage": "ZeRO stage 0-3.", "gradient_clipping": "Max gradient norm.",
    "offload_optimizer_device": "none, cpu or nvme.", "offload_param_device": "none, cpu or nvme (stage 3).",
    "offload_optimizer_nvme_path": "Folder for offloaded optimizer states.",
    "offload_param_nvme_path": "Folder for offloaded parameters.", "zero3_init_flag": "true/false.",
    "zero3_save_16bit_model": "true/false.", "deepspeed_hostfile": "Hostfile (DeepSpeed's own multi-node launcher).",
    "deepspeed_exclusion_filter": "Hosts to exclude.", "deepspeed_inclusion_filter": "Hosts to include.",
    "deepspeed_multinode_launcher": "pdsh, standard, openmpi, mvapich, mpich, nossh or slurm.",
    "deepspeed_moe_layer_cls_names": "MoE layer class names, comma-separated.",
}
_FSDP = _section(_switch("use_fsdp", G_FSDP, "Shard the model with FSDP."), "fsdp_config", _HELP,
                 lambda name: _FSDP_ENV.get(name, name.upper()), hidden=("fsdp_backward_prefetch_policy",))

_DS_ENV = {
    "deepspeed_config_file": "HASTEN_DEEPSPEED_CONFIG_FILE", "zero_stage": "HASTEN_DEEPSPEED_ZERO_STAGE",
    "gradient_clipping": "HASTEN_GRADIENT_CLIPPING",
    "offload_optimizer_device": "HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "HASTEN_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "HASTEN_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "HASTEN_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "HASTEN_DEEPSPEED_ZERO3_INIT", "zero3_save_16bit_model": "HASTEN_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_moe_layer_cls_names": "HASTEN_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}
_DS = _section(_switch("use_deepspeed", G_DS, "Train with DeepSpeed."), "deepspeed_config", _HELP, _DS_ENV.get,
               skip=("gradient_accumulation_steps",))

G_FP8 = "fp8 (with --mixed_precision fp8; passed to the processes)"
_FP8_HELP = {
    "backend": "ao (torchao), te (Transformer Engine) or msamp (MS-AMP); default: the first installed.",
    "use_autocast_during_eval": "te: fp8 in eval mode too.", "margin": "te: scaling margin.",
    "interval": "te: steps between scale updates.", "fp8_format": "te: HYBRID, E4M3 or E5M2.",
    "amax_history_len": "te: amax history length.", "amax_compute_algo": "te: max or most_recent.",
    "override_linear_precision": "te: fprop,dgrad,wgrad in high precision, e.g. false,false,true.",
    "opt_level": "msamp: O1 or O2.", "enable_fsdp_float8_all_gather": "ao: all-gather FSDP2 shards in float8.",
    "pad_inner_dim": "ao: pad matmul dimensions to multiples of 16.",
}


def _fp8_setting(key: str) -> Setting:
    name = key if key.startswith("fp8_") else f"fp8_{key}"  # --fp8_format, not --fp8_fp8_format
    env = env_names(name.upper())  # HASTEN_FP8_MARGIN, then Accelerate's ACCELERATE_FP8_MARGIN
    return _s(name, G_FP8, _FP8_HELP[key], config=("fp8_config", key), env=env, child_env=env[0],
              store_true=key == "use_autocast_during_eval")


_FP8 = [_fp8_setting(key) for key in SECTIONS["fp8_config"]]

_PAR_HELP = {
    **{f"parallelism_config_{axis.name}_size": axis.help for axis in AXIS_TABLE},  # hasten.layout
    "parallelism_config_cp_backend": "torch.", "parallelism_config_cp_comm_strategy": "Stored for compatibility.",
    "parallelism_config_sp_backend": "hasten (its own all-to-all, the default) or deepspeed (Accelerate's name).",
    "parallelism_config_pp_schedule": "Pipeline schedule, torch's name: GPipe, 1F1B (default), Interleaved1F1B, "
                                      "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV.",
    "parallelism_config_pp_microbatches": "Microbatches each batch is split into (at least the number of stages).",
    "parallelism_config_pp_stages_per_rank": "Stages each pipeline process runs (2 for interleaved/V schedules).",
    "parallelism_config_pp_split_points": "Module names that begin a stage, comma-separated (default: even split).",
}
# The sizes reach the processes as Accelerate's PARALLELISM_CONFIG_* variables (read by ParallelismConfig).
_PAR = _section(_switch("use_parallelism_config", G_PAR, "Lay the processes out with the parallelism_config sizes."),
                "parallelism_config", _PAR_HELP, str.upper)

G_MEG = "Megatron-LM (Accelerate's flags, mapped onto the parallelism_config layout)"
_MEG_HELP = {
    "tp_degree": ("int", "Tensor-parallel degree (-> parallelism_config_tp_size)."),
    "pp_degree": ("int", "Pipeline-parallel degree (-> parallelism_config_pp_size)."),
    "num_micro_batches": ("int", "Microbatches of the pipeline (-> parallelism_config_pp_microbatches)."),
    "sequence_parallelism": ("bool", "Megatron's sequence parallelism: refused (use parallelism_config_cp_size)."),
    "recompute_activations": ("bool", "Megatron's activation recomputation: refused (use activation checkpointing)."),
    "use_distributed_optimizer": ("bool", "Megatron's distributed optimizer: refused (use FSDP2)."),
    "gradient_clipping": ("float", "Megatron's train-step clipping: not applied (call accelerator.clip_grad_norm_)."),
}
# Accelerate's --use_megatron_lm / ACCELERATE_USE_MEGATRON_LM and --megatron_lm_* / MEGATRON_LM_* / the
# megatron_lm_config section; commands/launch_megatron.py maps them onto the parallelism_config settings.
_MEG = [_s("use_megatron_lm", G_MEG, "Accelerate's Megatron-LM launch: hasten runs its layout natively (tensor "
           "parallelism, pipeline) with the script's own loop.", kind="bool", default=False, store_true=True,
           config=None, env=env_names("USE_MEGATRON_LM"))] + [
    _s(f"megatron_lm_{key}", G_MEG, help, kind=kind, config=("megatron_lm_config", f"megatron_lm_{key}"),
       env=(f"MEGATRON_LM_{key.upper()}",), minimum=1 if kind == "int" else None)
    for key, (kind, help) in _MEG_HELP.items()]

SETTINGS: dict[str, Setting] = {s.name: s for s in _CORE + _FSDP + _DS + _FP8 + _PAR + _MEG}


@dataclass
class Value:
    """An effective setting and where it came from."""

    value: Any
    source: str
    rank: int = DEFAULT

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"{self.value!r} ({self.source})"


@dataclass
class Resolved:
    values: dict[str, Value] = field(default_factory=dict)
    config_path: Optional[str] = None
    config: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name].value

    def set(self, name: str, value: Any, source: str, rank: int) -> None:
        self.values[name] = Value(value, source, rank)


def _flag_type(setting: Setting):
    def parse(text: str) -> Any:
        try:
            return coerce(setting.key, text)
        except BadValue as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.key.kind
    return parse


def _metavar(setting: Setting) -> str:
    key = setting.key
    if key.kind != "choice":
        return key.kind.upper()
    shown = [str(c).lower() if setting.name.startswith("dynamo") else str(c) for c in key.choices[:6]]
    return "{" + ",".join(shown) + (",...}" if len(key.choices) > 6 else "}")


def add_launch_arguments(parser: argparse.ArgumentParser, script: bool = True) -> None:
    """The flags of ``hasten launch`` (also used by ``hasten test`` and ``hasten config explain``)."""
    S = argparse.SUPPRESS
    parser.add_argument("--config_file", "--config-file", default=S, metavar="PATH",
                        help="Config file to read (default: $HASTEN_CONFIG_FILE, else ~/.cache/hasten/default_config.yaml).")
    parser.add_argument("-q", "--quiet", action="store_true", default=S, help="Print only errors.")
    parser.add_argument("--dry_run", "--dry-run", action="store_true", default=S,
                        help="Print each effective setting, where it came from, and the command; start nothing.")
    if script:
        parser.add_argument("-m", "--module", action="store_true", default=S,
                            help="The script is a module name, run like python -m.")
        parser.add_argument("--no_python", "--no-python", action="store_true", default=S,
                            help="The script is an executable; run it without python.")
    groups: dict[str, Any] = {}
    for setting in SETTINGS.values():
        group = groups.get(setting.group) or groups.setdefault(setting.group, parser.add_argument_group(setting.group))
        strings = list(setting.flags)
        for flag in setting.flags:
            if flag.startswith("--") and "_" in flag:
                strings.append(flag.replace("_", "-"))
        help_text = S if setting.hidden else setting.help
        if setting.store_true:
            group.add_argument(*strings, dest=setting.name, action="store_true", default=S, help=help_text)
        else:
            group.add_argument(*strings, dest=setting.name, type=_flag_type(setting), default=S, help=help_text,
                               metavar=_metavar(setting))
    if script:
        parser.add_argument("training_script", metavar="script",
                            help="The Python script (or module with -m, executable with --no_python).")
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER, metavar="...",
                            help="Arguments of the script.")


# ---------------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------------
_OPEN_MPI = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI")
_OTHER_MPI = [("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI"),
              ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_SIZE", "MVAPICH"),
              ("PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_SIZE", "PMIx")]


def scheduler_layout(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Node count, node rank and main address read from SLURM (inside srun) or MPI (inside mpirun).

    Expects one ``hasten launch`` per machine. Returns ``{setting: (value, source)}``. Open MPI's
    variables come first (mpirun inside a SLURM allocation also carries SLURM's), then a SLURM job
    step, then the other MPI runtimes (srun's PMI variables come with SLURM's own).
    """
    if environ.get(_OPEN_MPI[0]) and environ.get(_OPEN_MPI[1]):
        return _mpi_layout(environ, *_OPEN_MPI)
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_PROCID"):
        return _slurm_layout(environ)
    for names in _OTHER_MPI:
        if environ.get(names[0]) and environ.get(names[1]):
            return _mpi_layout(environ, *names)
    return {}


def _mpi_layout(env: Mapping[str, str], size_var: str, rank_var: str, local_var: str, label: str) -> dict:
    size, rank = _env_int(env, size_var), _env_int(env, rank_var)
    local = _env_int(env, local_var) if env.get(local_var) else 1
    if local > 1:
        raise HastenCLIError(
            f"{label} started {local} `hasten launch` processes on one machine ({local_var}={local}); start "
            "one per machine (Open MPI: mpirun --map-by ppr:1:node, MPICH: mpirun -ppn 1)"
        )
    out: dict[str, tuple[Any, str]] = {"num_machines": (size, f"{label}: {size_var}"),
                                       "machine_rank": (rank, f"{label}: {rank_var}")}
    if size > 1:
        addr = env.get("MASTER_ADDR") or slurm_master_addr(env)
        if not addr:
            raise HastenCLIError(
                f"{label} started hasten launch on {size} machines but MASTER_ADDR is not set; export "
                "MASTER_ADDR=<address of machine 0> to every process (Open MPI: mpirun -x MASTER_ADDR)"
            )
        out["main_process_ip"] = (addr, f"{label}: MASTER_ADDR" if env.get("MASTER_ADDR") else "SLURM: node list")
    return out


def _slurm_layout(env: Mapping[str, str]) -> dict:
    nodes_var = next((v for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(v)), None)
    nodes = _env_int(env, nodes_var) if nodes_var else 1
    tasks_var = next((v for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if env.get(v)), None)
    tasks = _env_int(env, tasks_var) if tasks_var else nodes
    if tasks != nodes:
        raise HastenCLIError(
            f"srun started {tasks} `hasten launch` tasks on {nodes} machine(s) ({tasks_var}={tasks}); start one "
            "per machine: srun --nodes=N --ntasks-per-node=1 hasten launch ..."
        )
    node_var = "SLURM_NODEID" if env.get("SLURM_NODEID") else "SLURM_PROCID"
    out: dict[str, tuple[Any, str]] = {"num_machines": (nodes, f"SLURM: {nodes_var or 'one node'}"),
                                       "machine_rank": (_env_int(env, node_var), f"SLURM: {node_var}")}
    if nodes > 1:
        addr = slurm_master_addr(env)
        if addr:
            out["main_process_ip"] = (addr, "SLURM: MASTER_ADDR" if env.get("MASTER_ADDR") else "SLURM: node list")
        port_src = "SLURM: MASTER_PORT" if env.get("MASTER_PORT") else "SLURM: port from SLURM_JOB_ID"
        out["main_process_port"] = (slurm_port(env), port_src)
    return out


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise HastenCLIError(f"environment variable {name}={env[name]!r} is not a whole number; fix or unset it") from None


def _config_value(cfg: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    if len(path) == 1:
        return cfg.get(path[0])
    return (cfg.get(path[0]) or {}).get(path[1])


FLAGS_GIVEN = "_flags_given"  # set by launch_command_parser(): the settings typed, where the others hold defaults


def flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line: those ``args`` records as typed (a namespace from
    ``launch_command_parser()``, which fills in defaults as Accelerate's does), else every non-None
    attribute (the CLI's parser leaves out what was not typed; a namespace built by hand names
    ``None`` for "not set")."""
    values = vars(args)
    typed = values.get(FLAGS_GIVEN)
    if typed is not None:
        return {name: values[name] for name in typed if name in values}
    return {name: value for name, value in values.items() if value is not None}


def resolve(args: argparse.Namespace, environ: Mapping[str, str], cfg: Mapping[str, Any],
            config_label: str = "config file") -> Resolved:
    """Each setting's effective value: flag, else environment, else config file, else default."""
    res = Resolved(config=dict(cfg))
    given = flags_given(args)
    scheduler = scheduler_layout(environ)
    for name, setting in SETTINGS.items():
        if name in given:
            shown = setting.flags[0]
            res.set(name, given[name], f"command line {shown}", FLAG)
            continue
        found = False
        for var in setting.env:
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            try:
                value = coerce(setting.key, raw)
            except BadValue as exc:
                raise HastenCLIError(f"environment variable {var}: {exc}; fix or unset it") from None
            res.set(name, value, f"environment {var}", ENV)
            found = True
            break
        if not found and name in scheduler:
            value, source = scheduler[name]
            res.set(name, value, source, ENV)
            continue
        if found:
            continue
        value = _config_value(cfg, setting.config) if setting.config else None
        if value is None and name == "gradient_accumulation_steps":
            value = _config_value(cfg, ("deepspeed_config", "gradient_accumulation_steps"))
            if value is not None:
                res.set(name, value, f"{config_label}: deepspeed_config.gradient_accumulation_steps", CONFIG)
                continue
        if value is not None:
            res.set(name, value, f"{config_label}: {'.'.join(setting.config)}", CONFIG)
        else:
            res.set(name, setting.key.default, "default", DEFAULT)
    _from_distributed_type(res, cfg, config_label)
    return res


def _from_distributed_type(res: Resolved, cfg: Mapping[str, Any], label: str) -> None:
    """The config's ``distributed_type`` sets multi_gpu / use_fsdp / use_deepspeed / use_cpu."""
    dtype = cfg.get("distributed_type")
    if dtype is None:
        return
    source = f"{label}: distributed_type {dtype}"
    implied = {
        "MULTI_GPU": "multi_gpu", "FSDP": "use_fsdp", "DEEPSPEED": "use_deepspeed", "MULTI_CPU": "use_cpu",
    }.get(dtype)
    if implied and res.values[implied].rank < CONFIG:
        res.set(implied, True, source, CONFIG)
    if dtype in ("FSDP", "DEEPSPEED") and res.values["multi_gpu"].rank < CONFIG and not cfg.get("use_cpu"):
        res.set("multi_gpu", True, source, CONFIG)


def pick_winner(res: Resolved, a: str, b: str, fix: str) -> None:
    """Two settings that cannot both be on: the higher-precedence source wins; a tie is an error."""
    va, vb = res.values[a], res.values[b]
    if not (va.value and vb.value):
        return
    if va.rank == vb.rank:
        where = "on the command line" if va.rank == FLAG else f"({va.source}; {vb.source})"
        raise HastenCLIError(f"{SETTINGS[a].flags[0]} and {SETTINGS[b].flags[0]} conflict {where}; {fix}")
    loser, winner = (a, va) if va.rank < vb.rank else (b, vb)
    res.set(loser, False, f"overridden by {winner.source}", min(va.rank, vb.rank))
