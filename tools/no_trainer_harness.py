"""Run transformers' ``examples/pytorch/**/run_*_no_trainer.py`` scripts on hasten (and Accelerate), offline.

The scripts are written for Accelerate; for hasten this harness copies each one with the word
``accelerate`` replaced by ``hasten`` (nothing else of the user's code changed), for Accelerate it
copies it unchanged. Both copies get the same edits where the installed packages moved on
(``adapt_to_installed_transformers``: transformers 5 has no ``send_example_telemetry`` and takes
``is_offline_mode`` from ``huggingface_hub``, Accelerate 1.x has no ``DistributedType.TPU``). It
builds what the scripts need locally -- tiny models built from configs and saved with
``save_pretrained``, a WordLevel tokenizer trained on generated text and saved as a
``PreTrainedTokenizerFast``, generated csv/json data (sentences; for glue a label; for swag
four endings, one holding "good"; for ner word tags, colours B-COL and animals B-ANI; for translation
the sentence and its words reversed; for qa SQuAD-shaped examples whose question lists the colours or
the animals and whose answer is the one such word in the context; for summarization json lines of a
``text`` and its ``summary``, the text's first three words), local ``accuracy``, ``seqeval``,
``sacrebleu``, ``squad`` and ``rouge`` metric scripts that ``evaluate.load`` finds in the working folder,
and for summarization an nltk data folder (``write_nltk_data``: an empty ``tokenizers/punkt`` folder the
script checks for, and an untrained Punkt parameter set, empty files under
``tokenizers/punkt_tab/english/``, that ``nltk.sent_tokenize`` loads) which every run finds through
``NLTK_DATA=<work>/nltk_data`` -- and runs each script (qa with its ``utils_qa.py`` copied beside it):

- ``1p``: one process (plain ``python script.py``), with ``--checkpointing_steps 2`` and tracking on;
- ``2p``: two CPU processes (hasten: ``hasten launch --cpu --num_processes 2``; Accelerate:
  ``torchrun --nproc_per_node 2`` with ``ACCELERATE_USE_CPU=true``, since ``accelerate launch --cpu``
  starts a single process);
- ``1p-resume`` / ``2p-resume``: the same again with ``--resume_from_checkpoint`` pointing at the
  first checkpoint (``step_2``, mid-epoch) the matching run wrote.

Each row gives the script's final metric (its ``all_results.json``) and, for resumed runs, the
largest difference between the resumed run's final weights and the uninterrupted run's (0 = exact).

Nothing is downloaded (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``, ``HF_EVALUATE_OFFLINE=1``).
nltk data is never downloaded (the harness writes it, see above).

Rerunning what tools/no_trainer_result.md reports::

    # 1. the scripts (outside the repository; never commit them): from huggingface/transformers at
    #    commit a22a4378d97d06b7a1d9abad6e0086d30fdea199, keeping the examples/pytorch layout:
    #    text-classification/run_glue_no_trainer.py, language-modeling/run_{clm,mlm}_no_trainer.py,
    #    multiple-choice/run_swag_no_trainer.py, token-classification/run_ner_no_trainer.py,
    #    translation/run_translation_no_trainer.py, summarization/run_summarization_no_trainer.py,
    #    question-answering/run_qa_no_trainer.py with its question-answering/utils_qa.py (the runs
    #    reported used utils_qa.py as stored at commit e3b8f49f021f206cf09529ed0810d0df7e8d7656; no copy
    #    at a22a4378 was at hand),
    #    e.g. into /work/transformers-examples/
    # 2. their extra packages into a folder of their own (not the main environment, no CUDA wheels):
    pip download -d /tmp/nt-deps-dl datasets evaluate
    pip install --no-deps --target /tmp/nt-deps /tmp/nt-deps-dl/<the wheels not installed already>
    #    (datasets, evaluate, pyarrow, pandas, dill, multiprocess, aiohttp and its helpers, ...;
    #    for ner also seqeval and scikit-learn; for translation sacrebleu, portalocker, tabulate, lxml;
    #    for summarization nltk and rouge_score (which imports absl-py) -- no nltk data: the harness
    #    writes its own)
    # 3. the runs (hasten from this checkout, Accelerate as installed):
    PYTHONPATH=$PWD/src:/tmp/nt-deps python tools/no_trainer_harness.py \
        --examples /work/transformers-examples --scripts clm,mlm,glue,swag,ner,translation,qa,summarization \
        --frameworks hasten,accelerate
    # Accelerate's 2-process runs stop at wait_for_everyone() after end_training(); their numbers
    # come from a second run without tracking:
    PYTHONPATH=$PWD/src:/tmp/nt-deps python tools/no_trainer_harness.py --examples /work/transformers-examples \
        --scripts clm,mlm,glue,swag,ner,translation,qa --frameworks hasten,accelerate --modes 2p,2p-resume --no_tracking \
        --work /tmp/nt-nt

Other options: ``--modes 1p,2p,1p-resume,2p-resume``, ``--work /tmp/nt`` (models, data, outputs
under ``out/<framework>/<script>-<mode>``, logs under ``logs/``), ``--timeout 600`` (seconds per run).
Prints one table row per run and ``N passed, N failed`` (skips counted apart); exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

from no_trainer_metrics import METRICS

WORDS = ("alpha beta gamma delta river stone cloud light green small quick brown lazy dog cat runs "
         "jumps over under near far blue red house tree").split()
LABEL_WORDS = ("good", "bad")  # glue: the label is whether the sentence holds the word "good"
MODES = ("1p", "2p", "1p-resume", "2p-resume")


@dataclasses.dataclass(frozen=True)
class ScriptSpec:
    """How to run one example script: its path under examples/pytorch, the tiny model it needs,
    its data files and arguments, and the ``evaluate`` metric it loads (None: none)."""

    path: str
    model: str  # "gpt2", "bert" or "bart"
    data: str  # "text", "glue", "swag", "ner", "translation" or "summarization"
    extra_args: tuple[str, ...] = ()
    metric: Optional[str] = None
    skip_reason: Optional[str] = None
    needs_datasets: bool = True  # the real scripts load their files with ``datasets``; the stand-in does not
    helpers: tuple[str, ...] = ()  # modules beside the script that it imports (copied, word-replaced, with it)


SPECS: dict[str, ScriptSpec] = {
    "clm": ScriptSpec("language-modeling/run_clm_no_trainer.py", "gpt2", "text", ("--block_size", "16")),
    "mlm": ScriptSpec("language-modeling/run_mlm_no_trainer.py", "bert", "text",
                      ("--max_seq_length", "16", "--line_by_line", "True")),
    "glue": ScriptSpec("text-classification/run_glue_no_trainer.py", "bert", "glue",
                       ("--max_length", "16", "--pad_to_max_length"), metric="accuracy"),
    "ner": ScriptSpec("token-classification/run_ner_no_trainer.py", "bert", "ner", ("--max_length", "16"),
                      metric="seqeval"),
    "swag": ScriptSpec("multiple-choice/run_swag_no_trainer.py", "bert", "swag", ("--max_seq_length", "32"),
                       metric="accuracy"),
    "qa": ScriptSpec("question-answering/run_qa_no_trainer.py", "bert", "qa",
                     ("--max_seq_length", "32", "--doc_stride", "8", "--learning_rate", "1e-3"), metric="squad",
                     helpers=("utils_qa.py",)),
    "summarization": ScriptSpec("summarization/run_summarization_no_trainer.py", "bart", "summarization",
                                ("--text_column", "text", "--summary_column", "summary", "--max_source_length", "16",
                                 "--max_target_length", "16", "--num_beams", "1"), metric="rouge"),
    "translation": ScriptSpec("translation/run_translation_no_trainer.py", "bart", "translation",
                              ("--source_lang", "en", "--target_lang", "ro", "--max_source_length", "16",
                               "--max_target_length", "16", "--num_beams", "1"), metric="sacrebleu"),
}

# ner's generated tags: colours and animals are one-word entities, every other word is outside (O).
ENTITY_TAGS = {**dict.fromkeys(("blue", "red", "green", "brown"), "B-COL"), **dict.fromkeys(("dog", "cat"), "B-ANI")}


def sentences(count: int, seed: int) -> list[str]:
    """``count`` generated sentences of 4-9 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS + list(LABEL_WORDS)) for _ in range(rng.randint(4, 9))) for _ in range(count)]


def swag_row(context: str, seed: int) -> list:
    """A SWAG-shaped row: context, header, four endings of which only the ``label``-th holds "good"."""
    rng = random.Random(seed)
    label = rng.randrange(4)
    endings = [" ".join(rng.choice(WORDS) for _ in range(3)) for _ in range(4)]
    endings[label] += " good"
    return [context, " ".join(rng.choice(WORDS) for _ in range(2)), *endings, label]


def build_tokenizer(folder: str) -> None:
    """Train a WordLevel tokenizer on generated text; save it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(sentences(200, 0), trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   bos_token="[CLS]", eos_token="[SEP]", model_max_length=32)
    fast.save_pretrained(folder)


def build_model(kind: str, folder: str) -> None:
    """A tiny model of ``kind`` built from a config, saved with its tokenizer in ``folder``."""
    import torch
    from transformers import (AutoTokenizer, BartConfig, BartForConditionalGeneration, BertConfig, BertForMaskedLM,
                              GPT2Config, GPT2LMHeadModel)

    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=16, n_layer=2, n_head=2))
    elif kind == "bert":
        model = BertForMaskedLM(BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=32,
                                           max_position_embeddings=32))
    elif kind == "bart":
        start, end = tokenizer.cls_token_id, tokenizer.sep_token_id
        model = BartForConditionalGeneration(BartConfig(
            vocab_size=vocab, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=start, eos_token_id=end, decoder_start_token_id=start,
            forced_bos_token_id=None, forced_eos_token_id=end))
    else:
        raise ValueError(f"no tiny model of kind {kind!r}; known: gpt2, bert, bart")
    model.save_pretrained(folder)


def write_data(kind: str, folder: str) -> list[str]:
    """Training and validation files for ``kind``; returns the script arguments naming them."""
    os.makedirs(folder, exist_ok=True)
    paths = {split: os.path.join(folder, f"{split}.{'csv' if kind in ('glue', 'swag') else 'json'}")
             for split in ("train", "validation")}
    for split, count in (("train", 48), ("validation", 16)):
        if kind == "qa":
            write_qa_data(paths[split], count, seed=1 if split == "train" else 2)
            continue
        rows = sentences(count, seed=1 if split == "train" else 2)
        if kind == "summarization":
            write_summarization_rows(rows, paths[split])
        elif kind in ("text", "ner", "translation"):
            with open(paths[split], "w") as f:
                for row in rows:
                    words = row.split()
                    record = {"text": row} if kind == "text" else \
                        {"tokens": words, "ner_tags": [ENTITY_TAGS.get(w, "O") for w in words]} if kind == "ner" \
                        else {"translation": {"en": row, "ro": " ".join(reversed(words))}}  # "ro": words reversed
                    f.write(json.dumps(record) + "\n")
        elif kind == "glue":
            with open(paths[split], "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["sentence1", "label"])
                writer.writerows([row, int("good" in row.split())] for row in rows)
        elif kind == "swag":
            with open(paths[split], "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["sent1", "sent2", "ending0", "ending1", "ending2", "ending3", "label"])
                writer.writerows(swag_row(row, i) for i, row in enumerate(rows))
        else:
            raise ValueError(f"no generated data of kind {kind!r}; known: text, glue, swag, ner, translation, qa, "
                             "summarization")
    return ["--train_file", paths["train"], "--validation_file", paths["validation"]]


# qa: the question lists a word class by its members; the answer is the one word of that class in the context.
QA_CLASSES = {"colour": ("blue", "red", "green", "brown"), "animal": ("dog", "cat")}


def qa_example(index: int, rng: random.Random) -> dict:
    """A SQuAD-shaped example: a context holding one colour and one animal, a question naming one class.

    Every third context is long (26-32 words), longer than ``--max_seq_length`` leaves for it, so the
    script splits it into overlapping features (``--doc_stride``) and its post-processing joins them.
    """
    fillers = [w for w in WORDS if not any(w in members for members in QA_CLASSES.values())]
    words = [rng.choice(fillers) for _ in range(rng.randint(24, 30) if index % 3 == 2 else rng.randint(3, 7))]
    for members in QA_CLASSES.values():
        words.insert(rng.randint(0, len(words)), rng.choice(members))
    asked = rng.choice(sorted(QA_CLASSES))
    answer = next(w for w in words if w in QA_CLASSES[asked])
    context = " ".join(words)
    start = len(" ".join(words[:words.index(answer)])) + (1 if words.index(answer) else 0)
    return {"id": f"q{index}", "title": asked, "context": context,
            "question": "which word is " + " ".join(QA_CLASSES[asked]),
            "answers": {"text": [answer], "answer_start": [start]}}


def write_qa_data(path: str, count: int, seed: int) -> None:
    """``count`` qa examples in the ``{"data": [...]}`` layout (the script loads its json with ``field="data"``)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        json.dump({"data": [qa_example(i, rng) for i in range(count)]}, f)


def write_summarization_rows(rows: list[str], path: str) -> None:
    """Json lines of a ``text`` and its ``summary``: the sentence's first three words (a tiny Bart learns to copy)."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"text": row, "summary": " ".join(row.split()[:3])}) + "\n")


def write_nltk_data(folder: str) -> None:
    """Offline nltk data for summarization, so that nothing is downloaded: the script checks that
    ``tokenizers/punkt`` exists (else it downloads it) and splits texts with ``nltk.sent_tokenize``,
    which loads the Punkt parameters from ``tokenizers/punkt_tab/english/``. Empty parameter files make
    an untrained Punkt model (no abbreviations, no collocations): it splits after every ``.``, and the
    generated texts have none. The runs find it through ``NLTK_DATA``."""
    os.makedirs(os.path.join(folder, "tokenizers", "punkt"), exist_ok=True)
    english = os.path.join(folder, "tokenizers", "punkt_tab", "english")
    os.makedirs(english, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        open(os.path.join(english, name), "w").close()


def hastenize(source: str) -> str:
    """The script's text with the word ``accelerate`` replaced by ``hasten`` (what a migrating user does)."""
    return re.sub(r"\baccelerate\b", "hasten", source)


def adapt_to_installed_transformers(source: str) -> str:
    """The script's text, changed only where the installed transformers no longer has what it imports.

    transformers 5 dropped ``send_example_telemetry`` (the stored scripts predate that); the import and
    the call are removed. Accelerate 1.x renamed ``DistributedType.TPU`` to ``XLA`` (clm and mlm still
    name TPU, and fail under Accelerate 1.15 itself). Applied to both frameworks alike, so it cannot
    favour either.
    """
    import transformers.utils

    import accelerate

    if not hasattr(accelerate.DistributedType, "TPU"):  # renamed XLA; hasten has only the new name too
        source = source.replace("DistributedType.TPU", "DistributedType.XLA")
    if not hasattr(transformers.utils, "is_offline_mode"):  # summarization's; transformers 5 takes huggingface_hub's
        source = source.replace("from transformers.utils import check_min_version, is_offline_mode",
                                "from huggingface_hub import is_offline_mode\n"
                                "from transformers.utils import check_min_version")
    if not hasattr(transformers.utils, "send_example_telemetry"):
        source = source.replace("check_min_version, send_example_telemetry", "check_min_version")
        source = re.sub(r"^(\s*)send_example_telemetry\(.*\)$", r"\1pass", source, flags=re.M)
    return source


def checkpoints(output_dir: str) -> list[str]:
    """The ``step_N`` folders a run left in ``output_dir`` in step order, then the ``epoch_N`` ones."""
    if not os.path.isdir(output_dir):
        return []
    found = [d for d in os.listdir(output_dir) if re.fullmatch(r"(step|epoch)_\d+", d)]
    return sorted(found, key=lambda d: (d.startswith("epoch"), int(d.split("_")[1])))


def first_checkpoint(output_dir: str) -> Optional[str]:
    """The earliest ``step_N`` (else ``epoch_N``) folder a run left in ``output_dir``."""
    found = checkpoints(output_dir)
    return os.path.join(output_dir, found[0]) if found else None


@dataclasses.dataclass
class RunResult:
    script: str
    mode: str
    status: str  # "pass", "FAIL" or "skip"
    seconds: float = 0.0
    note: str = ""
    framework: str = "hasten"
    metrics: dict = dataclasses.field(default_factory=dict)  # the script's all_results.json


def launcher(framework: str, processes: int) -> list[str]:
    """The command line that starts a script under ``framework`` on ``processes`` CPU processes."""
    if processes == 1:
        return [sys.executable]
    if framework == "hasten":
        return [sys.executable, "-m", "hasten.commands.cli", "launch", "--cpu", "--num_processes", str(processes)]
    # ``accelerate launch --cpu`` starts one process; its multi-CPU path is torchrun's environment,
    # which Accelerator reads (ACCELERATE_USE_CPU, set by run_one, keeps it off any accelerator).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]


def output_dir_of(work: str, framework: str, name: str, mode: str) -> str:
    return os.path.join(work, "out", framework, f"{name}-{mode}")


def max_weight_difference(dir_a: str, dir_b: str) -> Optional[float]:
    """Largest absolute difference between the ``model.safetensors`` of two runs (None: one is missing)."""
    paths = [os.path.join(d, "model.safetensors") for d in (dir_a, dir_b)]
    if not all(os.path.exists(p) for p in paths):
        return None
    from safetensors.torch import load_file

    a, b = (load_file(p) for p in paths)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def run_one(name: str, script: str, mode: str, base_args: list[str], work: str, timeout: int,
            framework: str = "hasten") -> RunResult:
    """Run ``script`` in ``mode``; pass means exit 0, the final model saved and (first runs) a checkpoint."""
    processes = 2 if mode.startswith("2p") else 1
    output_dir = output_dir_of(work, framework, name, mode)
    whole_dir = output_dir_of(work, framework, name, mode.split("-")[0])
    shutil.rmtree(output_dir, ignore_errors=True)
    args = base_args + ["--output_dir", output_dir]
    if mode.endswith("resume"):
        checkpoint = first_checkpoint(whole_dir)
        if checkpoint is None:
            return RunResult(name, mode, "FAIL", note="the run to resume left no checkpoint", framework=framework)
        args += ["--resume_from_checkpoint", checkpoint]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_CACHE=os.path.join(work, "datasets-cache"),
               HF_HOME=os.path.join(work, "hf-home"), TOKENIZERS_PARALLELISM="false", ACCELERATE_USE_CPU="true",
               NLTK_DATA=os.path.join(work, "nltk_data"))
    log_path = os.path.join(work, "logs", f"{framework}-{name}-{mode}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    start = time.monotonic()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(launcher(framework, processes) + [script] + args, cwd=work, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - start
    if code is None:
        return RunResult(name, mode, "FAIL", seconds, f"timed out after {timeout} s; log {log_path}", framework)
    problems = [] if code == 0 else [f"exit {code}: {last_error(log_path)}"]
    if code == 0 and not os.path.exists(os.path.join(output_dir, "config.json")):
        problems.append("no final model saved")
    if code == 0 and not mode.endswith("resume") and first_checkpoint(output_dir) is None:
        problems.append("no checkpoint written")
    if code == 0 and mode.endswith("resume"):
        # A resumed run must take as many steps as the run it resumes: its last step folder is the same
        # (a run resumed from the whole run's last step folder writes none).
        whole = [d for d in checkpoints(whole_dir) if d[0] == "s"]
        ours = [d for d in checkpoints(output_dir) if d[0] == "s"]
        if whole and whole[-1] != os.path.basename(checkpoint) and (ours or ["its start"])[-1] != whole[-1]:
            problems.append(f"resumed run ended at {(ours or ['its start'])[-1]}, the whole run at {whole[-1]}")
    remarks = []
    if code == 0 and mode.endswith("resume"):
        # How far the resumed weights land from the uninterrupted run's (0 for an exact resume).
        gap = max_weight_difference(whole_dir, output_dir)
        remarks += [] if gap is None else [f"weights vs uninterrupted run: max |diff| {gap:.1e}"]
    metrics = {}
    if os.path.exists(os.path.join(output_dir, "all_results.json")):
        with open(os.path.join(output_dir, "all_results.json")) as f:
            metrics = json.load(f)
    return RunResult(name, mode, "FAIL" if problems else "pass", seconds, "; ".join(problems + remarks),
                     framework, metrics)


def last_error(log_path: str) -> str:
    """The last line of ``log_path`` that names an error, else its last line."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def prepare_script(examples: str, spec: ScriptSpec, work: str, framework: str = "hasten") -> str:
    """Copy the script and the modules it imports from its folder (qa's utils_qa.py) into
    ``work/scripts/<framework>`` (for hasten: word replaced); returns the script's path."""
    folder = os.path.join(work, "scripts", framework)
    os.makedirs(folder, exist_ok=True)
    for name in (os.path.basename(spec.path), *spec.helpers):
        with open(os.path.join(examples, os.path.dirname(spec.path), name)) as f:
            text = adapt_to_installed_transformers(f.read())
        with open(os.path.join(folder, name), "w") as f:
            f.write(hastenize(text) if framework == "hasten" else text)
    return os.path.join(folder, os.path.basename(spec.path))


def common_args(spec: ScriptSpec, work: str, name: str, tracking: bool = True) -> list[str]:
    """Model, data, and the small training settings every run of ``name`` shares."""
    model_dir = os.path.join(work, "models", spec.model)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_model(spec.model, model_dir)
    data_args = write_data(spec.data, os.path.join(work, "data", name))
    return ["--model_name_or_path", model_dir, *data_args, "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--num_train_epochs", "2", "--seed", "42",
            "--checkpointing_steps", "2", *(["--with_tracking", "--report_to", "tensorboard"] if tracking else []),
            *spec.extra_args]


# The stand-in under tools/no_trainer_standin (hasten's own, for the test): same arguments, no ``datasets``.
STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no_trainer_standin")
STANDIN_SPECS = {"clm": dataclasses.replace(SPECS["clm"], needs_datasets=False)}


def run_harness(examples: str, names: list[str], modes: list[str], work: str, timeout: int,
                frameworks: tuple[str, ...] = ("hasten",), tracking: bool = True) -> list[RunResult]:
    """Every (script, framework, mode) run; a script that cannot run here is one ``skip`` row with its reason."""
    os.makedirs(work, exist_ok=True)
    for metric, source in METRICS.items():  # evaluate.load(name) finds ./name/name.py in the working folder
        os.makedirs(os.path.join(work, metric), exist_ok=True)
        with open(os.path.join(work, metric, f"{metric}.py"), "w") as f:
            f.write(source)
    write_nltk_data(os.path.join(work, "nltk_data"))
    results = []
    for name in names:
        spec = STANDIN_SPECS[name] if os.path.samefile(examples, STANDIN) else SPECS[name]
        reason = spec.skip_reason or missing_requirement(spec, examples)
        if reason:
            results.append(RunResult(name, "all", "skip", note=reason))
            continue
        base_args = common_args(spec, work, name, tracking)
        for framework in frameworks:
            script = prepare_script(examples, spec, work, framework)
            for mode in modes:
                result = run_one(name, script, mode, base_args, work, timeout, framework)
                print(format_row(result), flush=True)
                results.append(result)
    return results


def missing_requirement(spec: ScriptSpec, examples: str) -> Optional[str]:
    """Why ``spec`` cannot run here (a missing file or package), else None."""
    for path in (spec.path, *(os.path.join(os.path.dirname(spec.path), h) for h in spec.helpers)):
        if not os.path.exists(os.path.join(examples, path)):
            return f"{path} not found under {examples}"
    needed = (["datasets"] if spec.needs_datasets else []) + (["evaluate"] if spec.metric else []) + \
        ([spec.metric] if spec.metric in ("seqeval", "sacrebleu") else []) + \
        (["rouge_score", "nltk"] if spec.metric == "rouge" else [])
    import importlib.util

    absent = [pkg for pkg in needed if importlib.util.find_spec(pkg) is None]
    return f"needs {', '.join(absent)} (pip install {' '.join(absent)})" if absent else None


def format_row(result: RunResult) -> str:
    metrics = ", ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in result.metrics.items()
                        if isinstance(v, (int, float)))
    return (f"| {result.script:<13} | {result.framework:<10} | {result.mode:<9} | {result.status:<4} | "
            f"{result.seconds:6.1f} | {metrics} | {result.note} |")


def compare_frameworks(results: list[RunResult], work: str) -> list[str]:
    """One line per (script, mode) that passed under both frameworks: both final metrics and the
    largest difference between the two runs' final weights."""
    lines = []
    passed = {(r.script, r.mode, r.framework): r for r in results if r.status == "pass"}
    for (script, mode, framework), ours in passed.items():
        theirs = passed.get((script, mode, "accelerate"))
        if framework != "hasten" or theirs is None:
            continue
        gap = max_weight_difference(output_dir_of(work, "hasten", script, mode),
                                    output_dir_of(work, "accelerate", script, mode))
        lines.append(f"{script} {mode}: hasten {ours.metrics} / accelerate {theirs.metrics}; "
                     f"weights max |diff| {'n/a' if gap is None else f'{gap:.1e}'}")
    return lines


def add_run_arguments(parser: argparse.ArgumentParser, specs: Any, modes: Any, work: str) -> None:
    """The options every script harness takes: which scripts, modes and frameworks, where, how long."""
    parser.add_argument("--scripts", default=",".join(specs), help=f"comma-separated, from {', '.join(specs)}")
    parser.add_argument("--modes", default=",".join(modes), help=f"comma-separated, from {', '.join(modes)}")
    parser.add_argument("--work", default=work, help="scratch folder (models, data, outputs, logs)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    parser.add_argument("--frameworks", default="hasten",
                        help="comma-separated, from hasten, accelerate (accelerate runs the unchanged script)")


def chosen_runs(parser: argparse.ArgumentParser, args: argparse.Namespace, specs: Any,
                modes: Any) -> tuple[list[str], list[str], tuple[str, ...]]:
    """(scripts, modes, frameworks) named by ``add_run_arguments``' options; an unknown one is a usage error."""
    names = [n for n in args.scripts.split(",") if n]
    picked = [m for m in args.modes.split(",") if m]
    frameworks = tuple(f for f in args.frameworks.split(",") if f)
    unknown = [n for n in names if n not in specs] + [m for m in picked if m not in modes] + \
        [f for f in frameworks if f not in ("hasten", "accelerate")]
    if unknown:
        parser.error(f"unknown script, mode or framework {unknown}; scripts: {', '.join(specs)}; "
                     f"modes: {', '.join(modes)}; frameworks: hasten, accelerate")
    return names, picked, frameworks


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", required=True,
                        help="a transformers checkout's examples/pytorch folder (the scripts are read from there)")
    add_run_arguments(parser, SPECS, MODES, "/tmp/hasten-no-trainer")
    parser.add_argument("--no_tracking", action="store_true",
                        help="leave out --with_tracking (Accelerate's multi-process runs fail with it, see the result)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.examples):
        parser.error(f"--examples {args.examples!r} is not a folder; give a transformers checkout's examples/pytorch")
    names, modes, frameworks = chosen_runs(parser, args, SPECS, MODES)
    print("| script | framework | mode | result | secs | final metrics | note |\n|---|---|---|---|---|---|---|",
          flush=True)
    results = run_harness(os.path.abspath(args.examples), names, modes, os.path.abspath(args.work), args.timeout,
                          frameworks, not args.no_tracking)
    for result in results:
        if result.status == "skip":
            print(format_row(result))
    for line in compare_frameworks(results, os.path.abspath(args.work)):
        print(line)
    passed = sum(r.status == "pass" for r in results)
    failed = sum(r.status == "FAIL" for r in results)
    print(f"{passed} passed, {failed} failed, {sum(r.status == 'skip' for r in results)} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
