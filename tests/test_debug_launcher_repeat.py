"""debug_launcher after failed launches in the same interpreter: after notebook_launcher failed, and
with an Accelerator made in the parent first. Each failure is kept (as a test runner keeps what it
caught) and the next launch must finish; a stuck launch prints every stack and fails the test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import faulthandler, sys
    sys.path.insert(0, {tests!r})
    import pytest
    from hasten import Accelerator, debug_launcher, notebook_launcher
    from hasten.launchers import LaunchError
    from test_accelerate_gaps import _agrees as agrees, _fails_at_once as fails_at_once, _fails_on_rank_one as fails_on_rank_one

    pattern, kept = {pattern!r}, []
    if pattern == "parent_accelerator":
        parent = Accelerator(cpu=True)
    for rep in range(3):
        faulthandler.dump_traceback_later(100, exit=True)
        for failing in (fails_at_once, fails_on_rank_one):
            with pytest.raises(LaunchError) as info:
                if pattern == "notebook":
                    notebook_launcher(failing, num_processes=2, use_port="0")
                else:
                    debug_launcher(failing)
            kept.append(info)
        debug_launcher(agrees)
        faulthandler.cancel_dump_traceback_later()
    print("all launches done")
""")


@pytest.mark.parametrize("pattern", ["notebook", "parent_accelerator"])
def test_debug_launcher_finishes_after_failed_launches(pattern: str) -> None:
    code = SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), pattern=pattern)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0 and "all launches done" in done.stdout, done.stderr[-3000:]
