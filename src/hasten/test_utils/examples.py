"""Checks that a "complete" example script contains what each single-feature example adds.

Accelerate's repository keeps ``examples/nlp_example.py`` (the plain loop), one script per feature
under ``examples/by_feature/`` and ``examples/complete_*_example.py`` combining them;
``compare_against_test`` returns the lines a feature script adds to the plain loop that the complete
script lacks (an empty list when it has them all). Paths are read relative to the working folder,
as in Accelerate.
"""

from __future__ import annotations

import os
from typing import Optional

_DATALOADER_LINE = "train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)\n"
_MOCK_MARKER = "TESTING_MOCKED_DATALOADERS"


def get_function_contents_by_name(lines: list[str], name: str) -> Optional[list[str]]:
    """The lines of the function ``name`` (``training_function`` or ``main``) in ``lines``: from its
    ``def`` up to the next top-level part (``def main`` after ``training_function``, the
    ``if __name__`` block after ``main``); None when the end is not found."""
    ends = {"training_function": "def main", "main": "if __name__"}
    if name not in ends:
        raise ValueError(f"Incorrect function name passed: {name}, choose either 'main' or 'training_function'")
    body: list[str] = []
    for line in lines:
        if not body:
            if f"def {name}" in line:
                body.append(line)
        elif ends[name] in line:
            return body
        else:
            body.append(line)
    return None


def clean_lines(lines: list[str]) -> list[str]:
    """``lines`` without comment lines and empty lines."""
    return [line for line in lines if line != "\n" and not line.lstrip().startswith("#")]


def _read_function(path: str, name: str) -> list[str]:
    with open(path) as f:
        body = get_function_contents_by_name(f.readlines(), name)
    if body is None:
        raise ValueError(f"{path} has no function {name}() followed by the part that ends it; "
                         "compare only scripts laid out like examples/nlp_example.py")
    return clean_lines(body)


def _new_lines(lines: list[str], template: list[str], skip_after_marker: bool, steps: int) -> list[str]:
    """The lines of ``lines`` not in ``template`` (the dataloader line and mocking lines aside), looking
    at ``steps`` lines (a mocking line and the statement it guards count as one)."""
    new, index = [], 0
    for _ in range(steps):
        if index >= len(lines):
            break
        line = lines[index]
        index += 1
        if line in template or line.lstrip() == _DATALOADER_LINE:
            continue
        if _MOCK_MARKER in line:
            index += 1 if skip_after_marker else 0  # the statement the mock guards (e.g. num_epochs = 2)
            continue
        new.append(line)
    return new


def compare_against_test(base_filename: str, feature_filename: str, parser_only: bool,
                         secondary_filename: Optional[str] = None) -> list[str]:
    """The lines ``feature_filename`` adds to ``examples/nlp_example.py`` that ``base_filename`` (a
    complete example) does not have. ``parser_only`` compares the ``main`` functions (argument
    parsing), else the ``training_function``s; ``secondary_filename`` is the template of a complete
    example built on another script than nlp_example.py (such as cv_example.py)."""
    name = "main" if parser_only else "training_function"
    template = _read_function(os.path.abspath(os.path.join("examples", "nlp_example.py")), name)
    feature, base = _read_function(feature_filename, name), _read_function(base_filename, name)
    # As in Accelerate, the feature script's last line (its function's closing line) is left out.
    feature_new = _new_lines(feature, template, skip_after_marker=True, steps=len(feature) - 1)
    base_new = _new_lines(base, template, skip_after_marker=False, steps=len(base))
    missing = [line for line in feature_new if line not in base_new]
    if secondary_filename is not None:
        secondary = _read_function(secondary_filename, name)
        with open(os.path.abspath(os.path.join("examples", "nlp_example.py"))) as f:
            only_in_template = [line for line in f.readlines() if line not in secondary]
        missing = [line for line in missing if line not in only_in_template]
    return missing
