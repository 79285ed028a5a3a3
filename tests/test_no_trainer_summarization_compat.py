"""What tools/no_trainer_harness.py gives transformers' ``run_summarization_no_trainer.py`` to run offline.

The script imports ``is_offline_mode`` from ``transformers.utils`` (gone in transformers 5), checks for
nltk's ``tokenizers/punkt`` (downloading it when missing), splits texts with ``nltk.sent_tokenize``
and scores with ``evaluate.load("rouge")``. The harness supplies each: an import edit, a local nltk
data folder, a local rouge metric script. Under hasten the script itself needed no fix (all 8 runs
pass, 1-process weights identical to Accelerate's; tools/no_trainer_result.md).
"""

import json
import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import no_trainer_harness as harness  # noqa: E402
from no_trainer_metrics import METRICS  # noqa: E402

SUMMARIZATION_IMPORT = "from transformers.utils import check_min_version, is_offline_mode, send_example_telemetry\n"


def test_the_summarization_import_line_imports_with_the_installed_transformers():
    adapted = harness.adapt_to_installed_transformers(SUMMARIZATION_IMPORT)
    names: dict = {}
    exec(adapted, names)  # the script's own line, as the harness hands it to both frameworks
    assert callable(names["is_offline_mode"]) and callable(names["check_min_version"])


def test_the_generated_summaries_are_each_texts_first_three_words(tmp_path):
    harness.write_data("summarization", str(tmp_path))
    with open(tmp_path / "train.json") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 48
    assert all(row["summary"].split() == row["text"].split()[:3] for row in rows)


def test_the_local_nltk_data_is_found_and_splits_sentences_without_a_download(tmp_path):
    pytest.importorskip("nltk")
    harness.write_nltk_data(str(tmp_path))
    code = ("import nltk; nltk.data.find('tokenizers/punkt'); "
            "print(nltk.sent_tokenize('blue dog runs. red cat jumps'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, NLTK_DATA=str(tmp_path)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['blue dog runs.', 'red cat jumps']"


def test_the_local_rouge_metric_gives_the_mean_f_measures_the_script_reads(tmp_path, monkeypatch):
    evaluate = pytest.importorskip("evaluate")
    pytest.importorskip("rouge_score")
    os.makedirs(tmp_path / "rouge")
    (tmp_path / "rouge" / "rouge.py").write_text(METRICS["rouge"])
    monkeypatch.chdir(tmp_path)  # evaluate.load("rouge") finds ./rouge/rouge.py, as in the harness's runs
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    metric = evaluate.load("rouge")
    metric.add_batch(predictions=["blue dog runs", "red cat"], references=["blue dog runs", "green tree"])
    result = metric.compute(use_stemmer=True)
    assert sorted(result) == ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    # One exact match (1.0) and one miss (0.0): the mean, a float the script can scale by 100.
    assert result["rouge1"] == pytest.approx(0.5) and result["rouge2"] == pytest.approx(0.5)
