"""transformers' ``run_*_no_trainer.py`` scripts, word-replaced, through tools/no_trainer_harness.py.

By default the harness runs its clm stand-in (tools/no_trainer_standin: same arguments and the same
Accelerate calls as the real script, no ``datasets`` needed) on 2 processes with checkpointing, then
resumes it on 2 processes. ``HASTEN_NO_TRAINER_FULL=1`` adds the one-process runs; with
``HASTEN_TRANSFORMERS_EXAMPLES=/path/to/transformers/examples/pytorch`` (and ``datasets``/``evaluate``
installed) it also runs the real scripts, every mode.
"""

import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import no_trainer_harness as harness  # noqa: E402

FULL = os.environ.get("HASTEN_NO_TRAINER_FULL") == "1"
EXAMPLES = os.environ.get("HASTEN_TRANSFORMERS_EXAMPLES")


def test_the_word_is_replaced_only_where_it_is_a_word():
    text = "from accelerate import Accelerator\nimport accelerate.utils  # accelerated, Accelerate\n"
    assert harness.hastenize(text) == "from hasten import Accelerator\nimport hasten.utils  # accelerated, Accelerate\n"


def test_checkpoints_are_found_step_first_in_numeric_order(tmp_path):
    for name in ("epoch_0", "step_12", "step_3", "other"):
        (tmp_path / name).mkdir()
    assert harness.first_checkpoint(str(tmp_path)) == str(tmp_path / "step_3")


def test_a_resumed_run_that_writes_no_later_checkpoint_fails(tmp_path):
    """The whole run left step_2 and step_4; resumed from step_2, a run that exits 0 with its final model
    but never reaches step 4 (it writes no step folder at all) took fewer steps: it fails. (The check
    compared the whole run's last folder with itself when the resumed run wrote none, and passed.)"""
    whole = tmp_path / "out" / "hasten" / "fake-1p"
    for step in ("step_2", "step_4"):
        (whole / step).mkdir(parents=True)
    script = tmp_path / "fake.py"
    script.write_text("import os, sys\n"
                      "out = sys.argv[sys.argv.index('--output_dir') + 1]\n"
                      "os.makedirs(out, exist_ok=True)\n"
                      "open(os.path.join(out, 'config.json'), 'w').write('{}')\n")
    result = harness.run_one("fake", str(script), "1p-resume", [], str(tmp_path), timeout=60)
    assert result.status == "FAIL" and "ended at its start" in result.note, (result.status, result.note)
    # The same run writing step_4 passes.
    script.write_text(script.read_text() + "os.makedirs(os.path.join(out, 'step_4'), exist_ok=True)\n")
    result = harness.run_one("fake", str(script), "1p-resume", [], str(tmp_path), timeout=60)
    assert result.status == "pass", result.note


def test_the_clm_stand_in_trains_checkpoints_and_resumes_on_two_processes(tmp_path):
    """Covers two fixes. ``wait_for_everyone()`` after ``end_training()`` (the real scripts do it with
    ``--with_tracking``) failed inside torch on every multi-process run. A resume from ``step_2``
    (mid-epoch) through ``skip_first_batches``, as the scripts do, lost the restored batches again
    in the next epoch (the harness checks that the resumed run ends at the same step)."""
    modes = list(harness.MODES) if FULL else ["2p", "2p-resume"]
    results = harness.run_harness(harness.STANDIN, ["clm"], modes, str(tmp_path), timeout=300)
    assert [(r.mode, r.status) for r in results] == [(m, "pass") for m in modes], \
        [(r.mode, r.note) for r in results]


@pytest.mark.skipif(not (FULL and EXAMPLES), reason="opt-in: HASTEN_NO_TRAINER_FULL=1 and "
                    "HASTEN_TRANSFORMERS_EXAMPLES=<transformers checkout>/examples/pytorch")
def test_the_real_scripts(tmp_path):
    results = harness.run_harness(EXAMPLES, list(harness.SPECS), list(harness.MODES), str(tmp_path), 600)
    failed = [(r.script, r.mode, r.note) for r in results if r.status == "FAIL"]
    assert not failed, failed
