"""``hasten estimate-memory``: training memory per process of a model, offline.

The model is built on the meta device (no weights, no memory) from a local transformers config
(a folder with ``config.json`` or the file itself) or from a class path ``package.module:Class``;
nothing is ever downloaded. The arithmetic and its assumptions live in ``memory_model``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any, Optional

from .errors import HastenCLIError, MissingFileError
from .memory_model import DTYPES

DEFAULT_NUM_PROCESSES = 8  # one node of 8 accelerators: the usual first step past one device
_CLASS_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def estimate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """The parser of ``hasten estimate-memory`` (a sub-command of ``subparsers``, or alone, as Accelerate's)."""
    from .arg_parser import ArgParser

    settings = dict(
        description="Build MODEL on the meta device (no download, no memory) and print, per dtype, the bytes of "
                    "parameters, gradients and Adam state per process for one process, DDP, ZeRO-1/2/3 and FSDP2 over "
                    "--num_processes processes, and the largest layer. MODEL is a local transformers config (a "
                    "folder holding config.json, or the file) or a class path package.module:Class.",
    )
    if subparsers is not None:
        p = subparsers.add_parser("estimate-memory", help="Estimate the training memory per process of a model (local "
                                  "config or class), per dtype and strategy.", **settings)
    else:
        p = ArgParser(prog="hasten estimate-memory", **settings)
    p.add_argument("model_name", metavar="MODEL",
                   help="A folder with config.json, a config.json file, or package.module:Class.")
    p.add_argument("--library_name", "--library-name", choices=["transformers", "timm"], default=None,
                   help="How to build MODEL: transformers (a config) or timm (an architecture name, e.g. "
                        "resnet50; built without weights). Default: guessed from MODEL.")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), metavar="DTYPE",
                   help=f"dtypes to report, any of {', '.join(DTYPES)} (default: all).")
    p.add_argument("--trust_remote_code", "--trust-remote-code", action="store_true",
                   help="Allow a local config's own modelling code (auto_map) to run.")
    p.add_argument("--num_processes", "--num-processes", type=int, default=DEFAULT_NUM_PROCESSES, metavar="N",
                   help=f"Processes that ZeRO and FSDP2 shard over (default: {DEFAULT_NUM_PROCESSES}).")
    p.add_argument("--model_kwargs", "--model-kwargs", default=None, metavar="JSON",
                   help="JSON object: keyword arguments for a class path, or config values to override "
                        "(e.g. '{\"num_hidden_layers\": 4}').")
    p.add_argument("--json", action="store_true", help="Print the numbers (bytes) as JSON instead of a table.")
    p.set_defaults(func=estimate_command)
    return p


def add_parser(subparsers: Any) -> None:
    estimate_command_parser(subparsers)


def _model_kwargs(text: Optional[str]) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise HastenCLIError(f"--model_kwargs {text!r} is not valid JSON ({e}); write e.g. '{{\"hidden_size\": 64}}'")
    if not isinstance(value, dict):
        raise HastenCLIError(f"--model_kwargs {text!r} must be a JSON object, e.g. '{{\"hidden_size\": 64}}'")
    return value


def _config_path(spec: str) -> Optional[str]:
    """The folder or file AutoConfig should read, or None when ``spec`` is not a local path."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise HastenCLIError(f"MODEL folder {spec!r} has no config.json; pass a folder holding a transformers "
                                 "config.json, the file itself, or a class path package.module:Class")
        return path
    if os.path.isfile(path):
        if not path.endswith(".json"):
            raise HastenCLIError(f"MODEL file {spec!r} is not a .json config; pass a transformers config.json, "
                                 "its folder, or a class path package.module:Class")
        return path
    return None


def build_model(spec: str, library_name: Optional[str] = None, trust_remote_code: bool = False,
                model_kwargs: Optional[dict[str, Any]] = None) -> tuple[Any, str]:
    """``(model on the meta device, its label)``; raises ``HastenCLIError`` for anything the user can fix."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: a config never needs the network here
    kwargs = dict(model_kwargs or {})
    if library_name == "timm":
        return _build_timm(spec, kwargs)
    config_path = _config_path(spec)
    if config_path is not None:
        return _build_transformers(spec, config_path, trust_remote_code, kwargs)
    if library_name is None and _CLASS_PATH.fullmatch(spec):
        return _build_class(spec, kwargs)
    raise _not_local(spec)


def _not_local(spec: str) -> MissingFileError:
    return MissingFileError(
        f"MODEL {spec!r} is neither a local config (folder with config.json, or the file) nor a class path "
        "package.module:Class; hasten estimate-memory never downloads: fetch the config first (e.g. "
        f"`huggingface-cli download {spec} config.json --local-dir {spec.split('/')[-1]}`) and pass the folder"
    )


def verify_on_hub(repo: str, token: Optional[str] = None) -> Any:
    """Accelerate's look-up of ``repo`` on the Hugging Face Hub. hasten's estimate-memory never contacts the
    Hub, so there is nothing to verify: this raises ``MissingFileError`` (a ``FileNotFoundError``, the
    ``OSError`` Accelerate raises for a repository it cannot use) saying how to fetch the config."""
    raise _not_local(repo)


def _build_transformers(spec: str, path: str, trust_remote_code: bool, kwargs: dict) -> tuple[Any, str]:
    try:
        import transformers
        from transformers import AutoConfig, AutoModel
    except ImportError:
        raise HastenCLIError(f"reading the config {spec!r} needs transformers: pip install transformers") from None
    import torch

    try:
        config, unused = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                    return_unused_kwargs=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - any reading failure is the user's file
        raise HastenCLIError(f"cannot read the transformers config {spec!r}: {_first_line(e)}") from None
    if unused:
        raise HastenCLIError(f"--model_kwargs: {', '.join(sorted(unused))} are not settings of the "
                             f"{type(config).__name__} in {spec!r}; check the names in its config.json")
    auto_map = getattr(config, "auto_map", None) or {}
    if auto_map and not trust_remote_code:
        raise HastenCLIError(f"the config {spec!r} uses its own modelling code (auto_map); pass --trust_remote_code "
                             "if you trust that code")
    architectures = getattr(config, "architectures", None) or []
    try:
        with torch.device("meta"):
            custom = next((k for k in auto_map if k.startswith("AutoModelFor")), None)
            if custom is not None:
                model = getattr(transformers, custom).from_config(config, trust_remote_code=True)
            elif architectures and hasattr(transformers, architectures[0]):
                # The full architecture (with its heads), not the bare AutoModel trunk.
                model = getattr(transformers, architectures[0])._from_config(config)
            else:
                model = AutoModel.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise HastenCLIError(f"cannot build the model of {spec!r} from its config: {_first_line(e)}") from None
    return model, f"{spec} ({type(model).__name__})"


def _build_class(spec: str, kwargs: dict) -> tuple[Any, str]:
    import importlib

    import torch

    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise HastenCLIError(f"cannot import {module_name!r} for MODEL {spec!r} ({_first_line(e)}); check the "
                             "module path and that the package is installed or on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise HastenCLIError(f"{module_name!r} has no {attr!r} (MODEL {spec!r}); write package.module:Class")
        obj = getattr(obj, part)
    if not callable(obj):
        raise HastenCLIError(f"MODEL {spec!r} is a {type(obj).__name__}, not a class; write package.module:Class")
    try:
        with torch.device("meta"):
            model = obj(**kwargs)
    except TypeError as e:
        raise HastenCLIError(f"cannot build {spec} with --model_kwargs {json.dumps(kwargs)}: {_first_line(e)}") from None
    except Exception as e:  # noqa: BLE001
        raise HastenCLIError(f"building {spec} failed: {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise HastenCLIError(f"MODEL {spec!r} built a {type(model).__name__}, not a torch.nn.Module")
    return model, spec


def _build_timm(spec: str, kwargs: dict) -> tuple[Any, str]:
    try:
        import timm
    except ImportError:
        raise HastenCLIError("--library_name timm needs timm: pip install timm") from None
    import torch

    try:
        with torch.device("meta"):
            model = timm.create_model(spec, pretrained=False, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise HastenCLIError(f"timm cannot build {spec!r}: {_first_line(e)}; pass an architecture name such as "
                             "resnet50 (timm.list_models())") from None
    return model, f"{spec} (timm)"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def measure(model: Any, name: str) -> Any:
    """The ``ModelSizes`` of a (meta) model: parameters, buffers and its largest gathered layer."""
    from .memory_model import ModelSizes

    sizes = ModelSizes(name)
    for param in model.parameters():  # tied parameters once
        entry = (param.numel(), param.shape[0] if param.dim() else 1)
        (sizes.trainable if param.requires_grad else sizes.frozen).append(entry)
    for buf in model.buffers():
        if buf.is_floating_point():
            sizes.float_buffers += buf.numel()
        else:
            sizes.other_buffer_bytes += buf.numel() * buf.element_size()
    sizes.largest_layer, sizes.layer_rule = largest_layer(model)
    return sizes


def largest_layer(model: Any) -> tuple[tuple[str, int], str]:
    """The unit FSDP2 / ZeRO-3 gathers at once with the most parameters, and the rule used.

    With ``_no_split_modules`` (transformers' layer classes): each such layer is one unit and the
    parameters outside them (embeddings, head, final norm) form one more at the root, as
    transformer-based wrapping gathers them. Without: each module's own parameters (Accelerate's
    definition of a layer for models it knows nothing about).
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    seen: set[int] = set()
    units: list[tuple[str, int]] = []
    if classes:
        for name, module in model.named_modules():
            if type(module).__name__ in classes and not any(name.startswith(u + ".") for u, _ in units):
                units.append((name, _count(module.parameters(), seen)))
        if units:
            rest = _count(model.parameters(), seen)
            units.append(("(root: parameters outside the layers)", rest))
            return max(units, key=lambda u: u[1]), "layers of _no_split_modules and the rest at the root"
    for name, module in model.named_modules():
        units.append((name or "(root)", _count(module.parameters(recurse=False), seen)))
    best = max(units, key=lambda u: u[1]) if units else ("", 0)
    return best, "the module with the most parameters of its own (no _no_split_modules)"


def _count(params: Any, seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _report(args: argparse.Namespace) -> dict[str, Any]:
    from .memory_model import estimate_all

    if args.num_processes < 1:
        raise HastenCLIError(f"--num_processes {args.num_processes} must be at least 1, e.g. --num_processes 8")
    kwargs = _model_kwargs(args.model_kwargs)
    model, label = build_model(args.model_name, args.library_name, args.trust_remote_code, kwargs)
    return estimate_all(measure(model, label), list(dict.fromkeys(args.dtypes)), args.num_processes)


def gather_data(args: argparse.Namespace) -> list[list[Any]]:
    """One row per dtype, as Accelerate's ``gather_data``: ``[dtype, bytes of the largest layer, bytes of
    the model, {strategy: total bytes per process}]`` (hasten's strategies: single, DDP, ZeRO-1/2/3, FSDP2;
    a loading-only dtype has one ``load`` entry). ``args`` from ``estimate_command_parser()``."""
    from .memory_model import BYTES

    report = _report(args)
    rows = []
    for dtype, per_strategy in report["bytes_per_process"].items():
        width = BYTES[dtype]
        rows.append([dtype, report["largest_layer"]["parameters"] * width, report["parameters"] * width,
                     {name: cols["total"] for name, cols in per_strategy.items()}])
    return rows


def estimate_command(args: argparse.Namespace) -> int:
    from .memory_model import render

    report = _report(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
