"""``hasten launch``: work out the settings (torch-free), then start the processes.

One process with no distributed settings is simply ``exec``-ed. Anything else goes through torch's
elastic agent (``torch.distributed.launcher.api``), imported only at that moment, with each child
wrapped by ``_bootstrap.py`` so that a failure can be traced to the rank that failed first.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import re
import shutil
import sys
from typing import Any, Mapping, Optional

from ..topology import DEFAULT_PORT
from .arg_parser import ArgParser
from .config_schema import default_config_path, read_config
from .errors import HastenCLIError
from .hardware import cpu_count, cuda_device_count
from .launch_layout import check_layout
from .launch_megatron import apply_megatron
from .launch_settings import (
    CONFIG, DEFAULT, FLAG, FLAGS_GIVEN, SETTINGS, Resolved, add_launch_arguments, pick_winner, resolve,
)
from .plan import Plan
from .ports import PICKED_PORT, free_port, port_in_use

_TEE = re.compile(r"^[0-3]$|^[0-9]+:[0-3](,[0-9]+:[0-3])*$")
_UNSUPPORTED_TYPES = ("XLA",)
_OTHER_ACCELERATORS = {"MULTI_XPU": "xpu", "MULTI_NPU": "npu", "MULTI_MLU": "mlu", "MULTI_MUSA": "musa",
                       "MULTI_HPU": "hpu"}


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``hasten launch`` (a sub-command of ``subparsers``, or alone), as Accelerate's
    ``launch_command_parser``: ``launch_command(launch_command_parser().parse_args([...]))`` launches."""
    settings = dict(
        help="Start a training script on every process (torch's elastic agent).",
        description="Start SCRIPT on the configured processes. Each setting comes from its flag, else the "
                    "environment, else the config file, else its default (see --dry_run). Flags take hyphens "
                    "too (--num-processes for --num_processes).",
        usage="hasten launch [flags] script.py [script args]  (or -m module, --no_python program)",
    )
    if subparsers is not None:
        parser = subparsers.add_parser("launch", **settings)
        parser.set_defaults(func=_launch_from_cli)
    else:
        settings.pop("help")
        parser = _FilledParser(prog="hasten launch", **settings)
        parser.set_defaults(func=launch_command)
    add_launch_arguments(parser)
    return parser


class _FilledParser(ArgParser):
    """The parser ``launch_command_parser()`` returns: every setting not typed holds its default on the
    namespace (``args.multi_gpu is False``), as with Accelerate's parser; the settings typed are recorded
    so that the config file and the environment still fill the others when the job is resolved."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        values = vars(parsed)
        typed = frozenset(name for name in SETTINGS if name in values)
        for name, setting in SETTINGS.items():
            values.setdefault(name, setting.key.default)
        for name in ("config_file", "quiet", "dry_run", "module", "no_python"):
            values.setdefault(name, None if name == "config_file" else False)
        values[FLAGS_GIVEN] = typed
        return parsed, rest


def add_parser(subparsers: Any) -> None:
    launch_command_parser(subparsers)


def _config(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[Optional[str], dict, str]:
    explicit = getattr(args, "config_file", None)
    path = os.path.expanduser(explicit) if explicit else default_config_path(environ)
    if explicit or os.path.isfile(path):
        return path, read_config(path), f"config file {path}"
    return None, {}, "config file"




def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _resolve_settings(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Optional[str], dict, str, Resolved]:
    """The config file read (path, content, label for messages) and each setting's value, settings that
    exclude each other settled."""
    config_path, cfg, label = _config(args, env)
    res = resolve(args, env, cfg, label)
    pick_winner(res, "use_cpu", "multi_gpu", "drop one (--cpu runs on CPU, --multi_gpu on every GPU)")
    pick_winner(res, "use_fsdp", "use_deepspeed", "choose one of FSDP and DeepSpeed")
    return config_path, cfg, label, res


def build_plan(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None, need_script: bool = True) -> Plan:
    """Resolve and check every setting; raise ``HastenCLIError`` (one line) on bad input."""
    env = os.environ if environ is None else environ
    config_path, cfg, label, res = _resolve_settings(args, env)
    res.config_path = config_path
    hostfile = getattr(args, "mpirun_hostfile", None) or (cfg.get("mpirun_config") or {}).get("mpirun_hostfile")
    if hostfile:
        # Accelerate would start every process through mpirun; ignoring the hostfile would wait for machines
        # that never join.
        where = "command line" if getattr(args, "mpirun_hostfile", None) else label
        raise HastenCLIError(f"mpirun_hostfile {hostfile} ({where}): "
                             "hasten launch does not start processes through mpirun; run `mpirun -ppn 1 ... hasten "
                             "launch script.py` instead (hasten reads the machine layout from MPI's environment and "
                             "starts each machine's processes itself), and drop mpirun_config")
    quiet = bool(getattr(args, "quiet", False))
    res.set("quiet", quiet, "command line -q" if quiet else "default", FLAG if quiet else DEFAULT)
    notes: dict[str, str] = {}
    gpus = cuda_device_count(env)
    device = _pick_device(res, cfg, label, gpus, env)
    machines, machine_rank = res["num_machines"], res["machine_rank"]
    if machine_rank >= machines:
        raise HastenCLIError(
            f"machine_rank {machine_rank} ({_src(res, 'machine_rank')}) must be below num_machines {machines} "
            f"({_src(res, 'num_machines')}); machines are numbered from 0"
        )
    gpu_ids = _gpu_ids(res, device)
    procs = _count_processes(res, device, gpus, gpu_ids, machines, env.get("CUDA_VISIBLE_DEVICES"))
    per_node = procs // machines
    # Accelerate's Megatron-LM settings become the native layout before it is checked.
    megatron_env, megatron_warnings = apply_megatron(res, cfg, label, procs)
    check_layout(res, procs, device)  # a layout that cannot fit: refused here, not in every rank
    backend, ip, port, rdzv_configs = _rendezvous(res, machines, machine_rank, procs, notes)
    tee, log_dir, restarts = res["tee"], res["log_dir"], res["max_restarts"]
    if tee is not None and not _TEE.match(tee):
        raise HastenCLIError(f"--tee {tee!r} is not 0-3 or a rank:value list; e.g. --tee 3 (stdout and stderr) "
                             "or --tee 0:3,1:1")
    if log_dir and os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise HastenCLIError(f"--log_dir {log_dir} is a file; give a folder")
    ds_file = res["deepspeed_config_file"]
    if res["use_deepspeed"] and ds_file and not os.path.isfile(ds_file):
        raise HastenCLIError(f"deepspeed_config_file {ds_file} ({_src(res, 'deepspeed_config_file')}) does not exist; "
                             "give the path of a DeepSpeed JSON file")

    entrypoint, cmd_args = _command(args, need_script)
    direct = procs == 1 and restarts == 0 and tee is None and log_dir is None and machines == 1
    if res["use_deepspeed"]:
        distributed_type = "DEEPSPEED"
    elif res["use_fsdp"]:
        distributed_type = "FSDP"
    elif procs > 1:
        distributed_type = {"cpu": "MULTI_CPU", "cuda": "MULTI_GPU"}.get(device, f"MULTI_{device.upper()}")
    else:
        distributed_type = "NO"
    child_env = _child_env(res, device, per_node, gpu_ids, direct)
    child_env.update(megatron_env)
    for warning in megatron_warnings:  # once, here: the processes get the native layout, not the plugin
        print(warning, file=sys.stderr)
    if backend == "c10d" and restarts > 0 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        child_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    run_id = env.get("SLURM_JOB_ID") or f"hasten-{port}"
    return Plan(res, device, distributed_type, procs, per_node, machines, machine_rank, ip, port, backend, rdzv_configs,
                run_id, entrypoint, cmd_args, child_env, direct, notes,
                port_picked=res.values["main_process_port"].source.endswith(PICKED_PORT))


def _src(res: Resolved, name: str) -> str:
    return res.values[name].source


def _pick_device(res: Resolved, cfg: Mapping[str, Any], label: str, gpus: int, env: Mapping[str, str]) -> str:
    dtype = cfg.get("distributed_type", "NO")
    overridden = any(res.values[n].rank > CONFIG and res[n] for n in ("use_cpu", "multi_gpu"))
    if dtype in _UNSUPPORTED_TYPES and not overridden:
        raise HastenCLIError(
            f"{label}: distributed_type: {dtype} is not supported by hasten launch yet; pass --cpu or --multi_gpu, "
            "or set distributed_type to MULTI_GPU / MULTI_CPU"
        )
    if res["use_cpu"]:
        return "cpu"
    if res["multi_gpu"]:
        if gpus == 0:
            raise HastenCLIError(
                f"{_src(res, 'multi_gpu')} asks for GPUs but this machine shows none ({_why_no_gpu(env)}); "
                "add --cpu to run on CPU"
            )
        return "cuda"
    if dtype in _OTHER_ACCELERATORS:
        return _OTHER_ACCELERATORS[dtype]
    return "cuda" if gpus else "cpu"


def _why_no_gpu(env: Mapping[str, str]) -> str:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible!r}"
    return "no NVIDIA driver found"


def _gpu_ids(res: Resolved, device: str) -> Optional[str]:
    gpu_ids = res["gpu_ids"]
    if device != "cuda":
        if res.values["gpu_ids"].rank == FLAG and gpu_ids != "all":
            raise HastenCLIError(f"--gpu_ids {gpu_ids} conflicts with running on {device.upper()}; "
                                 "drop --gpu_ids or --cpu")
        return None
    if gpu_ids not in (None, "all"):
        # The ids become the processes' CUDA_VISIBLE_DEVICES: they count the machine's GPUs.
        physical = cuda_device_count({})
        bad = [i for i in gpu_ids.split(",") if int(i) >= physical]
        if bad:
            raise HastenCLIError(f"gpu_ids {gpu_ids} ({_src(res, 'gpu_ids')}) names GPU {bad[0]} but this machine "
                                 f"has {physical} (ids 0 to {physical - 1})")
    return gpu_ids


def _count_processes(res: Resolved, device: str, gpus: int, gpu_ids: Optional[str], machines: int,
                     visible: Optional[str]) -> int:
    """Processes in total over all machines (Accelerate's meaning of num_processes)."""
    procs = res["num_processes"]
    listed = len(gpu_ids.split(",")) if gpu_ids not in (None, "all") else None
    if procs is None:
        per = listed or (gpus if device == "cuda" else 1)
        procs = max(1, per) * machines
        res.set("num_processes", procs, f"default: {'one per GPU' if device == 'cuda' else 'one per machine'}",
                DEFAULT)
    where = f"num_processes {procs} ({_src(res, 'num_processes')})"
    if procs % machines:
        raise HastenCLIError(f"{where} counts the processes of all machines and must be a multiple of "
                             f"num_machines {machines}")
    per_node = procs // machines
    if listed is not None and listed != per_node:
        raise HastenCLIError(f"{where} gives {per_node} process(es) per machine but gpu_ids {gpu_ids} "
                             f"({_src(res, 'gpu_ids')}) lists {listed} GPU(s); make them agree")
    if device == "cuda" and listed is None:
        problem = processes_exceed_gpus(per_node, gpus, machines, visible)
        if problem:
            raise HastenCLIError(f"{where}: {problem}")
    return procs


def processes_exceed_gpus(per_node: int, gpus: int, machines: int, visible: Optional[str]) -> Optional[str]:
    """Why ``per_node`` processes cannot each have one of ``gpus`` GPUs, naming both fixes; None when they can.

    Two processes on one GPU would each ask NCCL for the same device and hang in their first
    collective, so the launch is refused before anything starts.
    """
    if per_node <= gpus:
        return None
    shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    fewer = max(1, gpus) * machines
    return (f"{per_node} process(es) per machine but this machine shows {gpus} GPU(s){shown}, and processes "
            f"cannot share a GPU; pass --num_processes {fewer} (one per GPU), or --cpu to run {per_node} "
            "processes on CPU")


def _rendezvous(res: Resolved, machines: int, machine_rank: int, procs: int,
                notes: dict[str, str]) -> tuple[str, str, int, dict[str, Any]]:
    """Backend, address, port and settings of the rendezvous (a free port on one machine)."""
    backend, value = res["rdzv_backend"], res.values["rdzv_backend"]
    if backend == "static" and value.rank <= CONFIG and res["max_restarts"] > 0 and machines == 1:
        # Static rendezvous shares the agent's store with every restart round, and the restarted
        # processes read the previous round's gloo addresses from it ("connectFullMesh ... Connection
        # refused", or a hang; pytorch#135712). On one machine c10d behaves the same otherwise, and is
        # given a store of its own per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE below). A config
        # file's static counts as a default: `hasten config` (and Accelerate's) writes it into every file.
        # An explicit --rdzv_backend static stays; hasten's own process group survives it (state.py).
        why = "default" if value.rank == DEFAULT else f"{value.source} said static"
        backend = "c10d"
        res.set("rdzv_backend", backend, f"{why}; c10d with --max_restarts on one machine: static restarts "
                "break gloo", value.rank)
    ip = res["main_process_ip"]
    if ip is None:
        if machines > 1:
            raise HastenCLIError(f"{machines} machines need the address of machine 0: pass --main_process_ip (or set "
                                 "main_process_ip in the config file, or MASTER_ADDR)")
        ip = "127.0.0.1"
        res.set("main_process_ip", ip, "default: one machine", DEFAULT)
    port = res["main_process_port"]
    if machines > 1 and port == 0:
        raise HastenCLIError("--main_process_port 0 (pick a free port) works on one machine only; every machine "
                             f"must be given the same port, e.g. --main_process_port {DEFAULT_PORT}")
    if port is None or port == 0:
        if machines == 1:
            port = free_port()
            value = res.values["main_process_port"]
            res.set("main_process_port", port, f"{value.source}: {PICKED_PORT}", value.rank)
        else:
            port = DEFAULT_PORT
            res.set("main_process_port", port, "default", DEFAULT)
    elif (machines == 1 or (machine_rank == 0 and backend == "static")) and procs > 1 and port_in_use(port):
        raise HastenCLIError(f"port {port} ({_src(res, 'main_process_port')}) is already in use on this machine "
                             "(another job?); pass --main_process_port 0 to pick a free port, or another number")
    configs: dict[str, Any] = {}
    for item in (res["rdzv_conf"] or "").split(",") if res["rdzv_conf"] else []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise HastenCLIError(f"--rdzv_conf {res['rdzv_conf']!r}: {item!r} is not key=value; "
                                 "e.g. --rdzv_conf timeout=600")
        configs[key.strip()] = value.strip()
    if backend == "static":
        configs["rank"] = machine_rank
    elif machines > 1 and res.values["machine_rank"].rank > DEFAULT:
        notes["machine_rank"] = f"ignored: {backend} rendezvous numbers the machines itself"
    return backend, ip, port, configs


def _command(args: argparse.Namespace, need_script: bool) -> tuple[str, list[str]]:
    script = getattr(args, "training_script", None)
    rest = list(getattr(args, "training_script_args", None) or [])
    module, no_python = getattr(args, "module", False), getattr(args, "no_python", False)
    if module and no_python:
        raise HastenCLIError("-m/--module and --no_python conflict: a module needs python; drop one")
    if not script:
        if need_script:
            raise HastenCLIError("hasten launch needs a script: hasten launch [flags] script.py [script args]")
        return "", []
    if no_python:
        if not (os.path.isfile(script) or shutil.which(script)):
            raise HastenCLIError(f"program {script!r} not found (not a file, not on PATH); "
                                 "check the name after the flags")
        return script, rest
    if module:
        top = script.split(".")[0]
        found = top in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(
            top, [os.getcwd()] + sys.path) is not None
        if not found:
            raise HastenCLIError(f"no module named {top!r} (looked in {os.getcwd()} and sys.path); "
                                 "check the name after -m")
        return sys.executable, ["-m", script, *rest]
    if not os.path.isfile(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
        hint = " (a flag before it may have taken a value it should not)" if not script.endswith(".py") else ""
        raise HastenCLIError(f"script {script!r} not found in {os.getcwd()}{hint}; give the path of a Python file, "
                             "or use -m for a module")
    return sys.executable, [script, *rest]


def _child_env(res: Resolved, device: str, per_node: int, gpu_ids: Optional[str], direct: bool) -> dict[str, str]:
    env: dict[str, str] = {}
    fsdp, deepspeed = res["use_fsdp"], res["use_deepspeed"]
    for name, setting in SETTINGS.items():
        if not setting.child_env or name == "num_cpu_threads_per_process":
            continue
        if setting.group.startswith("FSDP") and not fsdp or setting.group.startswith("DeepSpeed") and not deepspeed:
            continue
        if setting.group.startswith("fp8") and res["mixed_precision"] != "fp8":
            continue
        if name.startswith("dynamo_") and name != "dynamo_backend" and res["dynamo_backend"] in (None, "NO"):
            continue
        value = res[name]
        if value is None:
            continue
        if name == "dynamo_backend":
            value = str(value).lower()
        env[setting.child_env] = _fmt(value)
    threads = res.values["num_cpu_threads_per_process"]
    if threads.value is not None:
        env["OMP_NUM_THREADS"] = str(threads.value)
    elif not direct:
        value = max(1, cpu_count() // per_node) if device == "cpu" else 1
        why = "default: CPU cores / processes" if device == "cpu" else "default: 1 with GPUs"
        res.set("num_cpu_threads_per_process", value, why, DEFAULT)
        env["OMP_NUM_THREADS"] = str(value)
    if device == "cuda" and gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids
    return env


def explain(plan: Plan) -> str:
    """Each effective setting and its source, then the command and the processes' environment."""
    res = plan.res
    lines = ["hasten launch settings (command line > environment > config file > default):"]
    cfg = res.config_path or f"{default_config_path()} (not found; defaults used)"
    lines.append(f"  {'config_file':<34} {cfg}")
    shown = [n for n, s in SETTINGS.items()
             if not (s.group.startswith("FSDP") and not res["use_fsdp"] and n != "use_fsdp")
             and not (s.group.startswith("DeepSpeed") and not res["use_deepspeed"] and n != "use_deepspeed")
             and not (s.group.startswith("fp8") and res["mixed_precision"] != "fp8")
             and not (s.group.startswith("N-D") and res[n] in (None, False))
             and not s.hidden]
    for name in shown:
        v = res.values[name]
        value = _fmt(v.value) or "-"
        note = f"  [{plan.notes[name]}]" if name in plan.notes else ""
        lines.append(f"  {name:<34} {value:<20} {v.source}{note}")
    derived = f"derived ({plan.device}, {plan.num_processes} process(es))"
    lines.append(f"  {'distributed_type':<34} {plan.distributed_type:<20} {derived}")
    if plan.direct:
        lines.append("runs directly (one process, no agent):")
    else:
        lines.append(f"starts {plan.nproc_per_node} process(es) on machine {plan.machine_rank} of {plan.num_machines} "
                     f"with torch's elastic agent, {plan.rdzv_backend} rendezvous at {plan.main_ip}:{plan.main_port}:")
    lines.append("  " + " ".join(_display_command(plan)))
    lines.append("environment of each process:")
    lines.extend(f"  {k}={v}" for k, v in sorted(plan.child_env.items()))
    return "\n".join(lines)


def _display_command(plan: Plan) -> list[str]:
    if not plan.entrypoint:
        return ["(no script given)"]
    if plan.direct:
        return [plan.entrypoint, *plan.args]
    from .elastic import worker_command

    entrypoint, args = worker_command(plan)
    return [entrypoint, *args]


def _validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, bool]:
    """Fill ``args`` with each setting's effective value (flag, else environment, else config file, else
    default) and check the settings that exclude each other, as Accelerate's function of this name.

    Returns ``(args, config, mixed_precision_from_config)``: the config file as a ``ClusterConfig`` (None
    when none is read) and whether ``mixed_precision`` came from it.
    """
    from .config.config_args import ClusterConfig

    config_path, cfg, _, res = _resolve_settings(args, os.environ)
    for name in SETTINGS:
        setattr(args, name, res[name])
    config = ClusterConfig.from_dict(dict(cfg), f"config file {config_path}") if config_path else None
    return args, config, res.values["mixed_precision"].rank == CONFIG


def _launch_from_cli(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if getattr(args, "dry_run", False):
        print(explain(plan))
        return 0
    return run_plan(plan, exec_ok=getattr(args, "_exec_ok", False))


def launch_command(args: argparse.Namespace) -> None:
    """Run the job ``args`` (from ``launch_command_parser``) from Python and wait for it, as Accelerate's.

    The caller's environment is left as it was; a job that fails raises
    ``subprocess.CalledProcessError`` with its exit status (a bad setting: ``HastenCLIError``).
    """
    import subprocess

    code = _launch_from_cli(args)
    if code:
        raise subprocess.CalledProcessError(code, [args.training_script, *getattr(args, "training_script_args", [])])


def run_plan(plan: Plan, exec_ok: bool = False) -> int:
    """Start the job; returns the exit status (exec-s the script when one plain process is enough).

    The processes' settings go into this process's environment for the start only: a caller from
    Python (``launch_command``, ``test_command``) finds its environment as it was.
    """
    saved = dict(os.environ)
    os.environ.update(plan.child_env)
    try:
        if plan.direct:
            argv = [plan.entrypoint, *plan.args]
            sys.stdout.flush()
            sys.stderr.flush()
            if exec_ok:
                os.execvp(argv[0], argv)
            import subprocess

            return subprocess.call(argv)
        from .elastic import run_elastic

        return run_elastic(plan)
    finally:
        os.environ.clear()
        os.environ.update(saved)
