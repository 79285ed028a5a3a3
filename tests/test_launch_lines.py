"""What the processes of a job print reaches the terminal as whole lines (`hasten launch`, 2 ranks).

Workers run unbuffered, so one `print(a, b)` is several writes; without care two ranks printing at
the same time glue their text mid-line. Also: text without a newline still shows up, promptly.
"""

import os
import re
import subprocess
import sys
import time

import pytest

from scripts.launch_common import clean_env, hasten, script

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "hasten", "commands",
                         "_bootstrap.py")


@pytest.fixture
def env(tmp_path):
    return clean_env(tmp_path / "absent.yaml")


def whole_lines(text, stream, lines):
    """Assert each rank's LINES lines of ``stream`` arrived whole, one per line, all of them."""
    line_re = re.compile(rf"rank ([01]) {stream} (\d+) (x*|y*) end")
    seen = {0: set(), 1: set()}
    for line in text.splitlines():
        if f" {stream} " in line or line == "":
            match = line_re.fullmatch(line)
            assert match, f"a {stream} line is not one whole rank line: {line!r}"
            rank, i = int(match.group(1)), int(match.group(2))
            assert match.group(3) == ("x" if stream == "out" else "y") * (i % 50), line
            assert i not in seen[rank], f"{line!r} twice"
            seen[rank].add(i)
    assert seen == {0: set(range(lines)), 1: set(range(lines))}, {r: len(s) for r, s in seen.items()}


def test_each_line_a_rank_prints_arrives_whole(tmp_path, env):
    rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", script("launch_lines.py"), "2000"], env,
                             timeout=180)
    assert rc == 0, err
    whole_lines(out, "out", 2000)
    whole_lines(err, "err", 2000)
    for rank in (0, 1):
        assert f"\nrank {rank} two\n" in out and f"\nrank {rank} lines end\n" in out, out[-500:]
    assert out.endswith("rank 0 no newline at exit"), out[-200:]


def test_text_without_newline_shows_promptly(tmp_path):
    """A prompt (no newline, no flush) appears while the process goes on, not only at exit."""
    (tmp_path / "prompt.py").write_text(
        "import sys, time\n"
        "print('waiting for', 'the data', end='')\n"
        "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-u", BOOTSTRAP, str(tmp_path / "prompt.py")], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        got, deadline = b"", time.monotonic() + 20  # the interpreter starts in ~0.1 s; the text is due 0.2 s later
        while time.monotonic() < deadline and got != b"waiting for the data":
            time.sleep(0.05)
            got += proc.stdout.read() or b""
        assert got == b"waiting for the data"
        assert proc.poll() is None  # shown while the script still runs
    finally:
        proc.kill()
        proc.wait()
