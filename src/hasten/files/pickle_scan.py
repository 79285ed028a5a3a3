"""The pickle opcode scan of ``unpickling``'s restricted unpickler: before a pickle is unpickled, its
memo indices are checked against its size (the C unpickler grows its memo to twice the largest index it
is given, so a few crafted bytes could make it allocate gigabytes). Reads only; imports nothing of hasten.
"""

from __future__ import annotations

import io
import os
from typing import Any, Callable, Optional


def _opcode_arguments() -> dict:
    """Opcode byte -> how its argument is laid out: n >= 0 fixed bytes, else pickletools' negative codes
    (-1 up to a newline, -2/-3/-4/-5 counted by a 1/4/4/8-byte length), -6 two lines (GLOBAL, INST)."""
    import pickletools

    table = {}
    for op in pickletools.opcodes:
        n = 0 if op.arg is None else op.arg.n
        table[op.code.encode("latin-1")[0]] = -6 if op.name in ("GLOBAL", "INST") else n
    return table


_ARGUMENTS: dict = {}
_COUNT_BYTES = {-2: 1, -3: 4, -4: 4, -5: 8}
_PUT, _LONG_BINPUT, _STOP = ord("p"), ord("r"), ord(".")


def memo_problem(data: Any, i: int, limit: int) -> Optional[str]:
    """Walk the opcodes of the pickle at ``data[i:]`` (bytes or a map; to its STOP): what is wrong with a memo
    index larger than ``limit``, None when none is (an unknown opcode or a truncated argument ends the walk:
    the unpickler reports those)."""
    if not _ARGUMENTS:
        _ARGUMENTS.update(_opcode_arguments())
    table, size = _ARGUMENTS, len(data)
    while i < size:
        code = data[i]
        n = table.get(code)
        if n is None or code == _STOP:
            return None
        i += 1
        if n >= 0:
            if code == _LONG_BINPUT and int.from_bytes(data[i:i + 4], "little") > limit:
                return f"index {int.from_bytes(data[i:i + 4], 'little')}"
            i += n
        elif n in (-1, -6):
            end = data.find(b"\n", i)
            if n == -6 and end >= 0:
                end = data.find(b"\n", end + 1)
            if end < 0:
                return None
            if code == _PUT and data[i:end].strip().isdigit() and int(data[i:end]) > limit:
                return f"index {int(data[i:end])}"
            i = end + 1
        else:
            width = _COUNT_BYTES[n]
            count = int.from_bytes(data[i:i + width], "little", signed=n == -3)
            if count < 0:
                return None
            i += width + count
    return None


def scan_pickle(file: Any, refuse: Callable[[str], Exception]) -> int:
    """The bytes the pickle at ``file``'s position can hold (to its file's end), after checking its memo
    indices: the C unpickler grows its memo to twice the largest index it is given, so a 9-byte pickle
    storing at index 2**26 makes it allocate and clear 1 GiB. Pickle writers number memo entries from 0,
    one per object, so an index is never larger than the pickle. The file is not moved."""
    import mmap

    try:
        start = file.tell()
        if hasattr(file, "getvalue"):
            data: Any = file.getvalue()
        else:
            size = os.fstat(file.fileno()).st_size
            data = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) if size > start else b""
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return 0  # not a seekable file: only the calls are bounded (by the class's file_size)
    left = max(len(data) - start, 0)
    try:
        problem = memo_problem(data, start, left)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()
    if problem:
        raise refuse(f"stores a pickle memo entry at {problem}, beyond the {left} bytes of the pickle (a crafted "
                     "size: unpickling it would allocate memory in proportion to the index)")
    return left
