"""Run Accelerate's own test suite against hasten (and against Accelerate, for the baseline).

    python tools/accelerate_suite.py                      # both sides, tests from the mirror at HEAD
    python tools/accelerate_suite.py --side hasten --files test_cpu test_utils
    python tools/accelerate_suite.py --tests /path/to/accelerate/tests --extra-path /tmp/suite-deps

What it does, as a user migrating a test suite would:

1. takes a fetched copy of Accelerate's ``tests/`` folder: a folder given with ``--tests``, else the
   folder extracted (``git archive``, with ``examples/`` for tests/test_examples.py) from the git
   directory ``--repo`` at ``--ref``;
2. for the hasten side, copies it and replaces the lowercase word ``accelerate`` by ``hasten``
   everywhere in the text files (``import accelerate`` -> ``import hasten``, ``accelerate launch``
   -> ``hasten launch``, ``path_in_accelerate_package`` -> ``path_in_hasten_package``). Nothing else
   is renamed: ``Accelerator``, ``AccelerateTestCase`` and the ``ACCELERATE_*`` variables keep their
   names, as hasten keeps them;
3. runs pytest on each ``test_*.py`` file in its own process on CPU (``CUDA_VISIBLE_DEVICES=""``,
   Hugging Face Hub offline: nothing is downloaded), with a per-file time limit;
4. prints passed / failed / skipped / errors per file and in total for each side.

Packages the suite needs beyond hasten's own (``parameterized``) are not installed by this tool:
install them into a folder (``pip install --no-deps --target DIR parameterized``) and name it with
``--extra-path DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_REPO = "/work/.mirror/huggingface+accelerate/repo"
TEXT_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".sh", ".cfg", ".txt", ".md")
OUTCOMES = ("passed", "failed", "skipped", "errors")

# Loaded into each pytest run with -p: writes one JSON line per test outcome as it happens, so a
# file stopped by the time limit still reports what finished.
PLUGIN = '''
import json, os
_OUT = os.environ["SUITE_RESULTS"]

def _write(nodeid, outcome, message=""):
    with open(_OUT, "a") as f:
        f.write(json.dumps({"test": nodeid, "outcome": outcome, "message": message[:400]}) + "\\n")

def _reason(report):
    text = getattr(report, "longreprtext", "") or ""
    lines = [l for l in text.splitlines() if l.startswith("E ") and "Use -v to get more diff" not in l]
    # The first "E" lines say what went wrong (the assertion, the exception); the last ones are detail.
    return (" / ".join(l[1:].strip() for l in lines[:2]) if lines
            else text.strip().splitlines()[-1] if text.strip() else "")

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.skipped:
            outcome = "skipped"
        elif report.failed:
            outcome = "failed" if report.when == "call" else "errors"
        else:
            outcome = "passed"
        _write(report.nodeid, outcome, _reason(report) if outcome != "passed" else "")

def pytest_collectreport(report):
    if report.failed:
        _write(report.nodeid or "<collection>", "errors", _reason(report))
'''


@dataclass
class FileResult:
    """The outcome counts of one test file, and why its tests failed."""

    name: str
    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    timed_out: bool = False
    seconds: float = 0.0
    failures: list = field(default_factory=list)


def extract_tests(repo: str, ref: str, dest: str) -> str:
    """Extract ``tests/`` (and ``examples/``, which tests/test_examples.py reads) of the git directory
    ``repo`` at ``ref`` into ``dest``; return the tests' path."""
    archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", ref, "tests", "examples"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return os.path.join(dest, "tests")


def rename_word(src: str, dest: str) -> None:
    """Copy the folder ``src`` to ``dest``, replacing the word ``accelerate`` by ``hasten`` in
    text files and file names."""
    for folder, _, files in os.walk(src):
        target = os.path.join(dest, os.path.relpath(folder, src).replace("accelerate", "hasten"))
        os.makedirs(target, exist_ok=True)
        for name in files:
            source = os.path.join(folder, name)
            out = os.path.join(target, name.replace("accelerate", "hasten"))
            if name.endswith(TEXT_SUFFIXES):
                with open(source, encoding="utf-8", errors="surrogateescape") as f:
                    text = f.read()
                with open(out, "w", encoding="utf-8", errors="surrogateescape") as f:
                    f.write(text.replace("accelerate", "hasten"))
            else:
                shutil.copy2(source, out)


def run_file(workdir: str, relpath: str, env: dict, timeout: float) -> FileResult:
    """Run pytest on one file (cwd: the folder holding ``tests/``) and count its outcomes."""
    result = FileResult(relpath)
    results_file = os.path.join(workdir, ".suite_results.jsonl")
    if os.path.exists(results_file):
        os.remove(results_file)
    env = dict(env, SUITE_RESULTS=results_file)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_plugin", relpath]
    # A new session, so that a time-out ends the whole tree (launched ranks included).
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        result.timed_out = True
        os.killpg(proc.pid, 9)
        proc.wait()
    result.seconds = time.monotonic() - start
    if os.path.exists(results_file):
        with open(results_file) as f:
            for line in f:
                row = json.loads(line)
                result.counts[row["outcome"]] += 1
                if row["outcome"] in ("failed", "errors"):
                    result.failures.append((row["test"], row["message"]))
    if result.timed_out:
        result.failures.append((relpath, f"timed out after {timeout:.0f} s"))
    return result


def run_side(name: str, workdir: str, files: list, env: dict, timeout: float, log: Optional[str]) -> list:
    """Run every file of one side; print one line per file as it finishes."""
    print(f"== {name} ({workdir})", flush=True)
    results = []
    for relpath in files:
        res = run_file(workdir, relpath, env, timeout)
        results.append(res)
        c = res.counts
        note = " TIMEOUT" if res.timed_out else ""
        print(f"{name:10s} {relpath:45s} passed {c['passed']:4d} failed {c['failed']:4d} skipped {c['skipped']:4d} "
              f"errors {c['errors']:4d} ({res.seconds:.0f} s){note}", flush=True)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"side": name, "file": relpath, "counts": c, "timed_out": res.timed_out,
                                    "seconds": res.seconds, "failures": res.failures}) + "\n")
    total = {k: sum(r.counts[k] for r in results) for k in OUTCOMES}
    print(f"{name:10s} {'TOTAL':45s} passed {total['passed']:4d} failed {total['failed']:4d} "
          f"skipped {total['skipped']:4d} errors {total['errors']:4d}", flush=True)
    return results


def render_markdown(rows: list, source: str) -> str:
    """The docs section for the per-file rows of a log (``{"side", "file", "counts", "timed_out"}``)."""
    sides = {}
    for row in rows:
        sides.setdefault(row["side"], {})[row["file"]] = row
    files = sorted({row["file"] for row in rows})
    names = [s for s in ("accelerate", "hasten") if s in sides]

    def cell(side: str, name: str) -> str:
        row = sides[side].get(name)
        if row is None:
            return "not run"
        c = row["counts"]
        text = f"{c['passed']} / {c['failed']} / {c['skipped']} / {c['errors']}"
        return text + (" (timed out)" if row["timed_out"] else "")

    lines = ["## Accelerate's own test suite", "",
             f"Accelerate's `tests/test_*.py` ({source}), run on CPU with `python tools/accelerate_suite.py`: "
             "for hasten the word `accelerate` is replaced by `hasten` in the test files, nothing else. "
             "Each cell: passed / failed / skipped / errors (an error that stops a file at import counts once).",
             "", "| file | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| `{name}` | " + " | ".join(cell(side, name) for side in names) + " |" for name in files]
    totals = {side: {k: sum(r["counts"][k] for r in sides[side].values()) for k in OUTCOMES} for side in names}
    lines.append("| **total** | " + " | ".join(
        " / ".join(str(totals[side][k]) for k in OUTCOMES) for side in names) + " |")
    # What stops a whole file (an error in collecting it), side by side: what a user meets first.
    for side in names:
        stopped = [(name, row["failures"][0][1]) for name, row in sorted(sides[side].items())
                   if row.get("failures") and row["failures"][0][0] == name and not row["timed_out"]]
        if stopped:
            lines += ["", f"Files that stop before their first test under {side}:", ""]
            # Without the machine's paths: the docs must not name this checkout.
            lines += [f"- `{name}`: " + re.sub(r" \(/[^)]*\)", "", why).lstrip("E ").replace("|", "/")
                      for name, why in stopped]
    lines += ["", "Rerun: `python tools/accelerate_suite.py --extra-path DIR --markdown tools/accelerate_suite_result.md` "
              "(DIR holds the suite's extra packages: `pip install --no-deps --target DIR parameterized`), then "
              "`python tools/compat_table.py > docs/compatibility.md`."]
    return "\n".join(lines) + "\n"


def side_env(python_path: list) -> dict:
    """The environment of a side: CPU only, Hub offline, its own import path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HASTEN_", "ACCELERATE_", "PYTEST_"))}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(python_path), PYTHONDONTWRITEBYTECODE="1")
    return env


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", help="a fetched copy of Accelerate's tests/ folder (default: extract it from --repo)")
    parser.add_argument("--repo", default=DEFAULT_REPO, help="Accelerate's git directory (default: %(default)s)")
    parser.add_argument("--ref", default="HEAD", help="the commit or tag to extract tests/ at (default: %(default)s)")
    parser.add_argument("--side", choices=("both", "hasten", "accelerate"), default="both")
    parser.add_argument("--files", nargs="*", help="file stems to run (default: every tests/test_*.py)")
    parser.add_argument("--subfolders", action="store_true", help="also run tests/*/test_*.py (deepspeed, fsdp, tp)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per file (default: %(default)s)")
    parser.add_argument("--extra-path", action="append", default=[], help="a folder added to the import path")
    parser.add_argument("--hasten-src", default=os.path.join(ROOT, "src"), help="hasten's source (default: %(default)s)")
    parser.add_argument("--log", help="append one JSON line per file (counts and failure messages) here")
    parser.add_argument("--markdown", help="write the docs section (a table of the counts) to this file")
    parser.add_argument("--render", nargs="+", metavar="LOG", help="only write --markdown from earlier --log files")
    parser.add_argument("--workdir", help="where to put the copies (default: a temporary folder, removed)")
    args = parser.parse_args(argv)
    source = args.tests or f"Accelerate's repository at {args.ref}"
    if args.render:
        rows = [json.loads(line) for log in args.render for line in open(log)]
        text = render_markdown(rows, source)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        else:
            print(text, end="")
        return 0

    work = args.workdir or tempfile.mkdtemp(prefix="accelerate-suite-")
    try:
        original = os.path.join(work, "accelerate")
        os.makedirs(original, exist_ok=True)
        if args.tests:
            shutil.copytree(args.tests, os.path.join(original, "tests"), dirs_exist_ok=True)
        else:
            extract_tests(args.repo, args.ref, original)
        renamed = os.path.join(work, "hasten")
        rename_word(original, renamed)
        plugin_dir = os.path.join(work, "plugin")
        os.makedirs(plugin_dir, exist_ok=True)
        with open(os.path.join(plugin_dir, "suite_plugin.py"), "w") as f:
            f.write(PLUGIN)

        pattern = "tests/*/test_*.py" if args.subfolders else None
        files = sorted(os.path.join("tests", n) for n in os.listdir(os.path.join(original, "tests"))
                       if re.fullmatch(r"test_.*\.py", n))
        if pattern:
            files += sorted(os.path.join("tests", d, n) for d in os.listdir(os.path.join(original, "tests"))
                            if os.path.isdir(os.path.join(original, "tests", d))
                            for n in os.listdir(os.path.join(original, "tests", d)) if re.fullmatch(r"test_.*\.py", n))
        if args.files:
            files = [f for f in files if os.path.basename(f)[:-3] in args.files]

        extra = [os.path.abspath(p) for p in args.extra_path]
        sides = []
        if args.side in ("both", "accelerate"):
            sides.append(("accelerate", original, side_env([plugin_dir, *extra])))
        if args.side in ("both", "hasten"):
            sides.append(("hasten", renamed, side_env([plugin_dir, os.path.abspath(args.hasten_src), *extra])))
        totals, all_results = {}, []
        for name, folder, env in sides:
            results = run_side(name, folder, files, env, args.timeout, args.log)
            all_results.append((name, results))
            totals[name] = {k: sum(r.counts[k] for r in results) for k in OUTCOMES}
        print(json.dumps(totals))
        if args.markdown:
            rows = [{"side": name, "file": r.name, "counts": r.counts, "timed_out": r.timed_out, "failures": r.failures}
                    for name, results in all_results for r in results]
            with open(args.markdown, "w") as f:
                f.write(render_markdown(rows, source))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
