"""Tampered versions of a torch file for the attack tests (tests/test_attack_code.py).

Each payload is one way a file a checkpoint loader reads could be replaced: raw pickle gadgets (a
``__reduce__`` that creates a marker file), TorchScript archives (whose ``__setstate__`` prints
``RAN``: ``torch.load`` hands any zip holding ``constants.pkl`` to ``torch.jit.load``), zip variants
(TorchScript under another prefix, extra or duplicate records, compressed records, data before or after
the archive), nested and deep pickles, bit flips, truncation and emptying.
"""

from __future__ import annotations

import functools
import io
import pickle
import zipfile
from typing import Callable

import torch

RAN = "HASTEN-TORCHSCRIPT-RAN"  # what the TorchScript payload prints when torch.jit.load runs its code


class _Opens:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def gadget(marker: str, protocol: int = 4) -> bytes:
    """A raw pickle that creates ``marker`` when loaded (the global io.open)."""
    return pickle.dumps(_Opens(marker), protocol=protocol)


@functools.lru_cache(maxsize=None)
def torchscript() -> bytes:
    """A TorchScript archive whose ``__setstate__`` prints ``RAN``: code that runs when torch.jit.load reads it."""
    from typing import Tuple

    class Runs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = torch.ones(1)

        @torch.jit.export
        def __getstate__(self) -> Tuple[torch.Tensor, bool]:
            return (self.x, self.training)

        @torch.jit.export
        def __setstate__(self, state: Tuple[torch.Tensor, bool]) -> None:
            print("HASTEN-TORCHSCRIPT-RAN")
            self.x = state[0]
            self.training = state[1]

        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return a

    out = io.BytesIO()
    torch.jit.save(torch.jit.script(Runs()), out)
    return out.getvalue()


def _records(data: bytes) -> list[tuple[str, bytes]]:
    if data[:2] != b"PK":  # a legacy (non-zip) good file: the zip variants start from a torch.save zip
        out = io.BytesIO()
        torch.save({"w": torch.ones(2)}, out)
        data = out.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _zip(records: list[tuple[str, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as z:
        for name, value in records:
            z.writestr(zipfile.ZipInfo(name), value, compress_type=compression)
    return out.getvalue()


def _renamed(data: bytes, prefix: str) -> bytes:
    return _zip([(prefix + "/" + name.partition("/")[2], value) for name, value in _records(data)])


def _with(good: bytes, *extra: tuple[str, bytes]) -> bytes:
    records = _records(good)
    prefix = records[0][0].partition("/")[0]
    return _zip(records + [(n.replace("{p}", prefix), v) for n, v in extra])


def _replace_pkl(good: bytes, pkl: bytes) -> bytes:
    return _zip([(n, pkl if n.endswith("/data.pkl") else v) for n, v in _records(good)])


def _deep(depth: int = 200_000) -> bytes:
    """A pickle of lists nested ``depth`` deep (built without recursion by the unpickler)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _flip(data: bytes, at: int) -> bytes:
    at %= len(data)
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:]


# name -> (kind, builder(good bytes, marker path)). kind "code": must be refused (it would run code);
# "damage": refused or, for a flip in tensor data that no format check can see, loaded (never code).
PAYLOADS: dict[str, tuple[str, Callable[[bytes, str], bytes]]] = {
    "gadget": ("code", lambda good, m: gadget(m)),
    "gadget_protocol2": ("code", lambda good, m: gadget(m, 2)),
    "gadget_protocol0": ("code", lambda good, m: gadget(m, 0)),
    "gadget_in_zip": ("code", lambda good, m: _replace_pkl(good, gadget(m))),
    "torchscript": ("code", lambda good, m: torchscript()),
    "torchscript_other_prefix": ("code", lambda good, m: _renamed(torchscript(), "model")),
    "torchscript_deflated": ("code", lambda good, m: _zip(_records(torchscript()), zipfile.ZIP_DEFLATED)),
    "constants_added": ("code", lambda good, m: _with(good, ("{p}/constants.pkl", _records(torchscript())[-1][1]))),
    "code_added": ("code", lambda good, m: _with(good, ("{p}/code/__torch__/x.py", b"def f(): pass\n"))),
    "nested_archive": ("code", lambda good, m: _with(good, ("{p}/inner/archive/data.pkl", gadget(m)))),
    "second_prefix": ("code", lambda good, m: _with(good, ("other/constants.pkl", b"\x80\x02N."))),
    "duplicate_record": ("code", lambda good, m: _with(good, ("{p}/data.pkl", gadget(m)))),
    "torchscript_appended": ("code", lambda good, m: good + torchscript()),
    "prefix_data": ("code", lambda good, m: b"\x80\x02" + b"x" * 30 + torchscript()),
    "deep_pickle": ("damage", lambda good, m: _deep()),
    "deep_in_zip": ("damage", lambda good, m: _replace_pkl(good, _deep())),
    "empty": ("damage", lambda good, m: b""),
    "truncated_1": ("damage", lambda good, m: good[:1]),
    "truncated_half": ("damage", lambda good, m: good[: len(good) // 2]),
    "truncated_last": ("damage", lambda good, m: good[:-1]),
    "truncated_directory": ("damage", lambda good, m: good[:-30]),
    "flip_header": ("damage", lambda good, m: _flip(good, 3)),
    "flip_early": ("damage", lambda good, m: _flip(good, 40)),
    "flip_middle": ("damage", lambda good, m: _flip(good, len(good) // 2)),
    "flip_directory": ("damage", lambda good, m: _flip(good, -40)),
    "flip_end_record": ("damage", lambda good, m: _flip(good, -20)),
}

# The default run's sample (CI); HASTEN_ATTACK_FULL=1 runs every payload.
SAMPLE = ("gadget", "gadget_in_zip", "torchscript", "torchscript_other_prefix", "constants_added", "duplicate_record",
          "deep_in_zip", "empty", "truncated_half", "flip_directory")
