"""Crash safety and automatic recovery with real processes and real signals.

- kill -9 of the saving process at 20 random moments: the newest complete checkpoint always
  verifies and loads, training resumes from it and its numbering continues (scripts/ckpt_killer.py),
  with saves in the foreground (page-cache writes) and with ``save_state(blocking=False)`` (O_DIRECT
  writes);
- `hasten launch --max_restarts 1`: a worker SIGKILLed inside a save is restarted, resumes with
  ``resume="auto"`` and ends with the uninterrupted run's weights;
- SIGTERM to one worker with ``save_on_preemption()``: every worker saves at the same step boundary and
  exits cleanly; a new launch resumes and ends with the uninterrupted run's weights.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from scripts.launch_common import clean_env, free_port, hasten, ranks, script

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "cfg.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    return clean_env(cfg, OMP_NUM_THREADS=1)


def _launch(env, out, project, mode, restarts=0, extra=()):
    os.makedirs(out, exist_ok=True)
    args = ["launch", "--num_processes", "2", "--monitor_interval", "0.05", "--main_process_port", free_port(),
            *extra]
    if restarts:
        args += ["--max_restarts", str(restarts)]
    return args + [script("ckpt_recover.py"), out, project, mode]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
    root = tmp_path_factory.mktemp("clean")
    rc, out, err, _ = hasten(_launch(env, root / "out", root / "project", "clean"), env, timeout=300)
    seen = ranks(root / "out", 2)
    assert [s["steps"] for s in seen] == [12, 12], err
    return seen


def _selected(request, name):
    """The values of parameter ``name`` of this module's selected tests that use fixture ``request``
    is setting up, so that a fixture starts only the runs that will be read."""
    fixture = request.fixturename
    return sorted({item.callspec.params[name] for item in request.session.items
                   if item.module is request.module and fixture in item.fixturenames})


KILLER_WRITES = {"blocking": "buffered", "background": "direct"}


@pytest.fixture(scope="module")
def killers(request, tmp_path_factory):
    """The kill -9 runs of scripts/ckpt_killer.py, one per mode, started together: they mostly wait
    (fsyncs, the random delays before each kill), so side by side they cost about one of them."""
    started = {}
    for mode in _selected(request, "mode"):
        root = tmp_path_factory.mktemp(f"killer_{mode}")
        with open(root / "stderr", "w") as err:  # a file, not a pipe: nobody reads while the other runs
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "scripts", "ckpt_killer.py"), root / "report.json",
                                     root / "project", "20", "11", mode, KILLER_WRITES[mode]], stdout=subprocess.DEVNULL,
                                    stderr=err, env=dict(os.environ, OMP_NUM_THREADS="1"))
        started[mode] = (proc, root)
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("mode", ["blocking", "background"])  # background: O_DIRECT writes (KILLER_WRITES)
def test_kill_9_while_saving_never_loses_the_newest_complete_checkpoint(killers, mode):
    proc, root = killers[mode]
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (root / "stderr").read_text()[-3000:]
    report = json.loads((root / "report.json").read_text())
    assert report["errors"] == []
    rounds = report["rounds"]
    assert len(rounds) == 20
    # the kills were real and landed during saves: most rounds left a half-written save behind
    mid_save = sum(1 for prev, cur in zip([{"leftovers": []}] + rounds, rounds)
                   if set(cur["leftovers"]) - set(prev["leftovers"]))
    assert mid_save >= 8, rounds
    # training made progress across the kills and every child resumed where the last one stopped
    assert rounds[-1]["newest"][1] >= 19  # at least one complete save per round
    assert all(r["complete"] and len(r["complete"]) <= 3 for r in rounds[1:])


class _ShardedRanks:
    """The 2 ranks' fork servers of scripts/ckpt_killer_sharded.py (torch and hasten imported once per
    rank, not once per job): ``start`` runs one 2-process job and returns its processes' pids."""

    def __init__(self):
        self.servers, self.ended0 = [], None
        for rank in range(2):
            env = clean_env(os.devnull, RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2,
                            MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS=1, HASTEN_USE_CPU=1)
            self.servers.append(subprocess.Popen([sys.executable, script("ckpt_killer_sharded.py")], env=env,
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                 stderr=subprocess.DEVNULL, text=True))

    def start(self, project, saves, mode="blocking"):
        job = json.dumps([str(project), saves, mode, free_port()]) + "\n"
        for server in self.servers:
            server.stdin.write(job)
            server.stdin.flush()
        return [int(self._line(server, "pid")[1]) for server in self.servers]

    def line(self):
        """The next line rank 0's job printed, split (``exit <status>`` if it ended first)."""
        line = self.servers[0].stdout.readline().split()
        if line[:1] == ["exit"]:
            self.ended0 = line
        return line

    def finish(self):
        """Wait for both jobs to be gone (killed, or ended); their exit statuses."""
        first = self.ended0 or self._line(self.servers[0], "exit")
        self.ended0 = None
        return [int(first[1]), int(self._line(self.servers[1], "exit")[1])]

    def close(self):
        """End the servers (at the end of their input; killed if that takes more than a minute)."""
        for server in self.servers:
            try:
                server.stdin.close()
            except OSError:
                pass
        for server in self.servers:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    @staticmethod
    def _line(server, word):
        while True:
            line = server.stdout.readline().split()
            assert line, f"the fork server ended before printing {word!r}"
            if line[0] == word:
                return line


def _sharded_kills(project, mode):
    """4 rounds of both ranks SIGKILLed during saves, then a job that only resumes; returns the step
    the last one resumed at and how many rounds left a half-written save behind (asserting as it goes)."""
    import random

    from hasten.checkpointing import layout

    rng = random.Random(5)
    root = layout.auto_root(str(project))
    expected, mid_save = -1, 0
    ranks_ = _ShardedRanks()
    try:
        for round_ in range(4):
            pids = ranks_.start(project, 10_000, mode)
            try:
                hello = ranks_.line()
                assert hello[:1] == ["hello"] and int(hello[1]) == expected and hello[2] == "True", (round_, hello)
                # Kill only after this round completed one save, so that every round makes progress even on a
                # loaded machine; the next saves start at once, so the random delay lands mostly inside one.
                assert ranks_.line()[:1] == ["saved"], round_
                time.sleep(rng.uniform(0.05, 0.6))
            finally:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it died by itself (its failure is asserted above)
                        pass
                ranks_.finish()
            names = sorted(os.listdir(root))
            mid_save += any(n.startswith(".") for n in names)
            newest = layout.newest_complete(root)
            assert newest is not None, names
            manifest = layout.read_manifest(newest[1])
            assert manifest["layout"]["state_dict"] == "dcp"
            expected = _step_of(newest[1], manifest)
        ranks_.start(project, 0)  # the last kill's newest checkpoint loads too
        hello = ranks_.line()
        assert ranks_.finish() == [0, 0], hello
        assert hello == ["hello", str(expected), "True"], hello
    finally:
        ranks_.close()
    return expected, mid_save


@pytest.fixture(scope="module")
def sharded_kills(request, tmp_path_factory):
    """_sharded_kills for each selected mode, on threads started together (the rounds mostly wait for
    process start-up, the shards' fsyncs and the random delays): mode -> its result or its exception."""
    results = {}

    def run(mode, project):
        try:
            results[mode] = _sharded_kills(project, mode)
        except BaseException as e:  # noqa: BLE001 - handed to the test that reads this mode
            results[mode] = e

    threads = {mode: threading.Thread(target=run, args=(mode, tmp_path_factory.mktemp(f"sharded_{mode}") / "project"),
                                      daemon=True) for mode in _selected(request, "mode")}
    for thread in threads.values():
        thread.start()
    yield results, threads


@pytest.mark.parametrize("mode", ["blocking", "background"])
def test_kill_9_during_sharded_fsdp2_saves_leaves_the_previous_checkpoint_loadable(sharded_kills, mode):
    """Both ranks of an FSDP2 job SIGKILLed while they write DCP shards (in the foreground, or on the
    background thread of ``save_state(blocking=False)`` while the next step changes the weights): the next
    job resumes from the newest complete checkpoint, whose weights and Adam state agree with its recorded step."""
    results, threads = sharded_kills
    threads[mode].join(600)
    assert mode in results, "the rounds did not end within 600 s"
    if isinstance(results[mode], BaseException):
        raise results[mode]
    expected, mid_save = results[mode]
    assert expected >= 4 and mid_save >= 1


def _step_of(folder, manifest):
    from concurrent.futures import ThreadPoolExecutor

    from hasten.checkpointing.restorer import Reader

    with ThreadPoolExecutor(1) as pool:
        reader = Reader(folder, manifest, pool)
        step, _ = reader.state(manifest["contents"]["custom_objects"][0]["file"])
        reader.close()
    return int(step["value"])


def test_restart_after_kill_through_the_launcher_gives_the_uninterrupted_weights(tmp_path, env, uninterrupted):
    rc, out, err, _ = hasten(_launch(env, tmp_path / "out", tmp_path / "project", "kill", restarts=1), env,
                             timeout=300)
    seen = ranks(tmp_path / "out", 2)
    assert [s["attempt"] for s in seen] == [1, 1], err
    assert [s["resumed_at"] for s in seen] == [4, 4]  # the save at step 6 died half-way: step 4's is newest
    for rank in range(2):
        assert seen[rank]["weights"] == uninterrupted[rank]["weights"]
    names = sorted(os.listdir(tmp_path / "project" / "checkpoints"))
    assert names == ["checkpoint_4", "checkpoint_5"]  # numbering continued; no half-written folder left


def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path, env, uninterrupted):
    out, project = tmp_path / "out", tmp_path / "project"
    args = _launch(env, out, project, "preempt")
    proc = subprocess.Popen([sys.executable, "-m", "hasten.commands.cli", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "pid1").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (out / "pid1").exists(), proc.communicate(timeout=30)[0][-3000:]
        time.sleep(0.2)
        os.kill(int((out / "pid1").read_text()), signal.SIGTERM)  # one rank only: they must agree
        log = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    assert not (out / "rank0.json").exists()  # the script stopped at the boundary, it did not finish
    newest = project / "checkpoints" / "checkpoint_3"
    manifest = json.loads((newest / "manifest.json").read_text())
    # The signal came after micro-step 5 of the epoch's 6; the agreed boundary is an accumulation window (2)
    # later, past the end of the epoch: both save at the start of the next epoch.
    assert manifest["step"] == 0 and not manifest["mid_accumulation"]
    rc, text, err, _ = hasten(_launch(env, tmp_path / "again", project, "clean"), env, timeout=300)
    seen = ranks(tmp_path / "again", 2)
    assert [s["resumed_at"] for s in seen] == [6, 6], err
    for rank in range(2):
        assert seen[rank]["weights"] == uninterrupted[rank]["weights"]


def _uneven(env, out, project, mode):
    os.makedirs(out, exist_ok=True)
    args = ["launch", "--num_processes", "2", "--monitor_interval", "0.05", "--main_process_port", free_port(),
            script("preempt_uneven.py"), out, project, mode]
    return hasten(args, env, timeout=240)


def test_preemption_with_uneven_batches_per_process_neither_hangs_nor_mismatches(tmp_path, env):
    """Processes pass different numbers of batch boundaries (an evaluation loader of 3 batches on one
    process, 2 on the other): watching for preemption must not add a collective per boundary."""
    rc, _, err, _ = _uneven(env, tmp_path / "clean", tmp_path / "p0", "clean")
    assert rc == 0, err[-3000:]
    clean = ranks(tmp_path / "clean", 2)
    rc, _, err, secs = _uneven(env, tmp_path / "preempt", tmp_path / "p1", "preempt")
    assert rc == 0, err[-3000:]
    assert not os.path.exists(tmp_path / "preempt" / "rank0.json")  # stopped at the agreed boundary
    assert os.listdir(tmp_path / "p1" / "checkpoints") == ["checkpoint_0"]
    rc, _, err, _ = _uneven(env, tmp_path / "resumed", tmp_path / "p1", "resume")
    assert rc == 0, err[-3000:]
    resumed = ranks(tmp_path / "resumed", 2)
    for rank in range(2):
        assert resumed[rank]["weights"] == clean[rank]["weights"]
    assert [sum(r["evaluated"]) for r in clean] == [20, 20]  # 10 samples per epoch, gathered on every process

DEEPSPEED = ["--use_deepspeed", "--zero_stage", "2", "--gradient_clipping", "1.0"]


def test_deepspeed_kill_after_engine_files_resumes_from_the_previous_checkpoint(tmp_path, env):
    """ZeRO-2 engine checkpoints inside the commit: rank 1 dies once its engine files are written."""
    pytest.importorskip("deepspeed")
    clean = tmp_path / "clean"
    hasten(_launch(env, clean / "out", clean / "project", "clean", extra=DEEPSPEED), env, timeout=300)
    reference = ranks(clean / "out", 2)
    rc, out, err, _ = hasten(_launch(env, tmp_path / "out", tmp_path / "project", "kill", restarts=1,
                                     extra=DEEPSPEED), env, timeout=300)
    seen = ranks(tmp_path / "out", 2)
    assert [s["attempt"] for s in seen] == [1, 1], err
    assert [s["resumed_at"] for s in seen] == [4, 4]  # step 6's save died before its manifest
    for rank in range(2):
        assert seen[rank]["weights"] == reference[rank]["weights"]
    assert sorted(os.listdir(tmp_path / "project" / "checkpoints")) == ["checkpoint_4", "checkpoint_5"]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names the fsynced descriptors through /proc")
def test_a_save_fsyncs_every_file_and_folder_a_crash_needs_each_once(fresh_state, tmp_path, monkeypatch):
    """What the commit makes durable (every file, the folder, its parent after the rename), and nothing twice:
    an fsync flushes the device's cache even with nothing left to write, so a repeated one is pure cost."""
    import torch

    from hasten import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(4, 4)
    model, opt = acc.prepare(model, torch.optim.Adam(model.parameters()))
    model(torch.ones(2, 4, device=acc.device)).sum().backward()
    opt.step()
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    target = acc.save_state(tmp_path / "ckpt")
    monkeypatch.undo()
    assert len(synced) == len(set(synced)), f"fsynced more than once: {sorted(synced)}"
    temp = [p for p in synced if os.path.basename(p).startswith(".ckpt.tmp-")]
    assert len(temp) == 1 and str(tmp_path) in synced, synced
    for name in os.listdir(target):
        written = {os.path.join(temp[0], name)} | {  # the manifest: via files.durable's temporary file
            p for p in synced if os.path.dirname(p) == temp[0] and os.path.basename(p).startswith(f".{name}.")
            and p.endswith(".tmp")}
        assert written & set(synced), f"{name} was never fsynced: {synced}"
