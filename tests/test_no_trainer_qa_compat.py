"""transformers' ``run_qa_no_trainer.py`` on hasten: its evaluation pattern, and the harness's qa data.

The script evaluates with dynamically padded batches whose widths differ from rank to rank: it pads the
start/end logits across processes along dim 1 with -100, gathers them with ``gather_for_metrics``, and
copies each gathered batch into one ``(features, max width)`` array in order (``create_and_fill_np_array``).
Each feature's logits must land in its own row, whatever the world size and however unevenly the
features divide among the ranks (the harness's validation set divides evenly; 13 features here do not).
The checks run in real processes (tests/distributed.py), this module being their module too.
"""

import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import no_trainer_harness as harness  # noqa: E402

FEATURES = 13  # 2 ranks x batches of 4 leave an uneven remainder
WIDTHS = [5 + (i * 3) % 7 for i in range(FEATURES)]  # each feature's own (unpadded) length


def feature_logits(index: int) -> list[float]:
    """Feature ``index``'s logits: distinct values, so a misplaced row shows."""
    return [100.0 * index + position for position in range(WIDTHS[index])]


def check_qa_eval_gathers_every_feature_into_its_row():
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from hasten import Accelerator

    acc = Accelerator()

    def collate(indices):  # dynamic padding to the batch's widest feature (pad value unlike -100)
        width = max(WIDTHS[i] for i in indices)
        return torch.tensor([feature_logits(i) + [-1.0] * (width - WIDTHS[i]) for i in indices])

    loader = acc.prepare(DataLoader(list(range(FEATURES)), batch_size=4, collate_fn=collate))
    gathered = []
    for batch in loader:
        logits = acc.pad_across_processes(batch.to(acc.device), dim=1, pad_index=-100)
        gathered.append(acc.gather_for_metrics(logits).cpu().numpy())
    # What the script's create_and_fill_np_array does with the gathered batches.
    filled = np.full((FEATURES, max(g.shape[1] for g in gathered)), -100, dtype=np.float64)
    row = 0
    for batch in gathered:
        take = min(batch.shape[0], FEATURES - row)
        filled[row:row + take, :batch.shape[1]] = batch[:take]
        row += batch.shape[0]
    return {"rows_gathered": row, "features": [filled[i, :WIDTHS[i]].tolist() for i in range(FEATURES)]}


@pytest.mark.parametrize("processes", [1, 2])
def test_the_qa_evaluation_puts_every_feature_in_its_row(processes):
    from distributed import run_checks

    report = run_checks("test_no_trainer_qa_compat", world_size=processes, timeout=300,
                        only=["check_qa_eval_gathers_every_feature_into_its_row"])
    expected = [feature_logits(i) for i in range(FEATURES)]
    for value in report.assert_passed("check_qa_eval_gathers_every_feature_into_its_row"):
        assert value == {"rows_gathered": FEATURES, "features": expected}


def test_the_generated_qa_answers_are_where_answer_start_says():
    rng = random.Random(0)
    for index in range(200):
        example = harness.qa_example(index, rng)
        answer, start = example["answers"]["text"][0], example["answers"]["answer_start"][0]
        assert example["context"][start:start + len(answer)] == answer
        assert answer in harness.QA_CLASSES[example["title"]]
        assert example["context"].split().count(answer) == 1  # one word of the asked class: one right answer
