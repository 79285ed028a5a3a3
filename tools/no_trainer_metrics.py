"""Local stand-ins for the ``evaluate`` metrics the transformers no_trainer scripts load.

``evaluate.load(name)`` finds ``./name/name.py`` in the working folder before it would go to the Hub, so
``tools/no_trainer_harness.py`` writes each text below there. Each is written for the harness; the scores
the scripts read come from the packages that compute them (seqeval, sacrebleu, rouge_score).
"""

# A local stand-in for evaluate's "accuracy" metric: evaluate.load("accuracy") finds ./accuracy/accuracy.py
# in the working directory before it would go to the Hub.
ACCURACY_METRIC = '''
import datasets
import evaluate


class Accuracy(evaluate.Metric):
    """Fraction of predictions equal to their references (local, written for the hasten harness)."""

    def _info(self):
        return evaluate.MetricInfo(
            description="accuracy", citation="", inputs_description="predictions, references",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        hits = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": hits / max(len(references), 1)}
'''

# The same for "seqeval" (run_ner): the scores the script reads, computed by the seqeval package.
SEQEVAL_METRIC = '''
import datasets
import evaluate
from seqeval.metrics import accuracy_score, classification_report


class Seqeval(evaluate.Metric):
    """Entity-level precision, recall, f1 per entity type and overall (local, written for the hasten harness)."""

    def _info(self):
        tags = datasets.Sequence(datasets.Value("string"))
        return evaluate.MetricInfo(description="seqeval", citation="", inputs_description="tag sequences",
                                   features=datasets.Features({"predictions": tags, "references": tags}))

    def _compute(self, predictions, references):
        report = classification_report(references, predictions, output_dict=True, zero_division=0)
        overall = report.pop("micro avg")
        scores = {kind: {"precision": float(r["precision"]), "recall": float(r["recall"]),
                         "f1": float(r["f1-score"]), "number": int(r["support"])}
                  for kind, r in report.items() if not kind.endswith(" avg")}
        scores.update(overall_precision=float(overall["precision"]), overall_recall=float(overall["recall"]),
                      overall_f1=float(overall["f1-score"]),
                      overall_accuracy=float(accuracy_score(references, predictions)))
        return scores
'''
# The same for "sacrebleu" (run_translation): corpus BLEU by the sacrebleu package, one reference each.
SACREBLEU_METRIC = '''
import datasets
import evaluate
import sacrebleu


class Sacrebleu(evaluate.Metric):
    """Corpus BLEU of predictions against their references (local, written for the hasten harness)."""

    def _info(self):
        return evaluate.MetricInfo(
            description="sacrebleu", citation="", inputs_description="texts and their reference lists",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}))

    def _compute(self, predictions, references):
        streams = [list(refs) for refs in zip(*references)]  # one stream per reference position
        bleu = sacrebleu.corpus_bleu(predictions, streams)
        return {"score": bleu.score, "counts": bleu.counts, "precisions": bleu.precisions, "bp": bleu.bp,
                "sys_len": bleu.sys_len, "ref_len": bleu.ref_len}
'''
# The same for "squad" (run_qa): exact match and token F1 in percent, each prediction scored against its best
# reference answer after SQuAD's answer normalisation (lower case; punctuation, articles, extra spaces dropped).
SQUAD_METRIC = '''
import collections
import re
import string

import datasets
import evaluate


def normalized_words(text):
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return re.sub(r"\\b(a|an|the)\\b", " ", text).split()


def f1(prediction, reference):
    predicted, expected = normalized_words(prediction), normalized_words(reference)
    shared = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if not predicted or not expected:
        return float(predicted == expected)
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


class Squad(evaluate.Metric):
    """SQuAD v1 exact match and F1 (local, written for the hasten harness)."""

    def _info(self):
        answers = datasets.Sequence({"text": datasets.Value("string"), "answer_start": datasets.Value("int32")})
        return evaluate.MetricInfo(
            description="squad", citation="", inputs_description="{id, prediction_text} and {id, answers}",
            features=datasets.Features({
                "predictions": {"id": datasets.Value("string"), "prediction_text": datasets.Value("string")},
                "references": {"id": datasets.Value("string"), "answers": answers}}))

    def _compute(self, predictions, references):
        predicted = {p["id"]: p["prediction_text"] for p in predictions}
        exact = total_f1 = 0.0
        for reference in references:
            answer = predicted[reference["id"]]
            texts = reference["answers"]["text"]
            exact += max(float(normalized_words(answer) == normalized_words(t)) for t in texts)
            total_f1 += max(f1(answer, t) for t in texts)
        count = max(len(references), 1)
        return {"exact_match": 100.0 * exact / count, "f1": 100.0 * total_f1 / count}
'''

# The same for "rouge" (run_summarization): each pair scored by the rouge_score package, then the mean
# F-measure per rouge type (evaluate's own script reports the middle of a bootstrap over those scores,
# which draws random samples; the plain mean keeps the harness's runs reproducible).
ROUGE_METRIC = '''
import datasets
import evaluate
from rouge_score import rouge_scorer


class Rouge(evaluate.Metric):
    """Mean ROUGE F-measures of predictions against references (local, written for the hasten harness)."""

    def _info(self):
        return evaluate.MetricInfo(
            description="rouge", citation="", inputs_description="texts and their references",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, rouge_types=None, use_stemmer=False):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        scorer = rouge_scorer.RougeScorer(rouge_types, use_stemmer=use_stemmer)
        scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
        return {kind: sum(s[kind].fmeasure for s in scores) / max(len(scores), 1) for kind in rouge_types}
'''
METRICS = {"accuracy": ACCURACY_METRIC, "seqeval": SEQEVAL_METRIC, "sacrebleu": SACREBLEU_METRIC,
           "rouge": ROUGE_METRIC, "squad": SQUAD_METRIC}
