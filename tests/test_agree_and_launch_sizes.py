"""Issue 24, items 13 and 11.

13: a parallel layout (``--parallelism_config_*``) that cannot fit the job is refused by ``hasten launch``
    before anything starts: one line on stderr, exit 2, no traceback, no process, no torch import.
11: a save that fails on one rank only (its ``makedirs``) makes every rank raise the same error, and
    no rank is left waiting in a collective (2 real gloo processes, fault injected in rank 1).
"""

import os
import subprocess
import sys

import pytest

from scripts.launch_common import LEAKY_NAMES, LEAKY_PREFIXES, clean_env, hasten, script
from test_cli import one_line_error, plan_for  # the CLI's one-line-error convention, checked the same way


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """No launcher/scheduler variables from the outside; no config file unless a test writes one; no GPU."""
    for key in list(os.environ):
        if key.startswith(LEAKY_PREFIXES) or key in LEAKY_NAMES:
            monkeypatch.delenv(key)
    monkeypatch.setenv("HASTEN_CONFIG_FILE", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


# -- item 13: layout sizes checked by hasten launch -------------------------------------------
@pytest.mark.parametrize("argv, fragments", [
    (["--num_processes", "2", "--parallelism_config_tp_size", "3"],
     ["tp_size 3 (command line --parallelism_config_tp_size)", "= 3 processes", "runs 2",
      "num_processes 2 (command line --num_processes)", "--num_processes 3"]),
    (["--num_processes", "4", "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "3"],
     ["dp_shard_size 2", "tp_size 3", "= 6 processes", "runs 4"]),
    (["--num_processes", "1", "--parallelism_config_tp_size", "2"], ["= 2 processes", "runs 1"]),
    (["--num_processes", "4", "--parallelism_config_cp_size", "2", "--parallelism_config_sp_size", "2"],
     ["cp_size 2 (command line --parallelism_config_cp_size)", "sp_size 2 (command line --parallelism_config_sp_size)",
      "both split the sequences", "--parallelism_config_cp_size 1", "--parallelism_config_sp_size 1"]),
    (["--num_processes", "4", "--parallelism_config_sp_size", "2", "--parallelism_config_tp_size", "2"],
     ["sp_size 2", "tp_size 2", "composes with data parallelism", "--parallelism_config_tp_size 1"]),
    (["--num_processes", "2", "--parallelism_config_sp_size", "3"], ["sp_size 3", "= 3 processes", "runs 2"]),
    (["--num_processes", "4", "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_tp_size", "2"],
     ["dp_replicate_size 2", "tp_size 2", "dp_shard_size 1", "--parallelism_config_dp_shard_size 2"]),
])
def test_layout_that_cannot_fit_is_one_line_exit_2(cli, capsys, argv, fragments):
    err = one_line_error(capsys, ["launch", "--cpu", *argv, "train.py"])
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_layout_from_config_file_and_environment_is_checked_naming_the_source(cli, capsys, monkeypatch):
    cfg = cli / "cfg.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\n"
                   "parallelism_config:\n  parallelism_config_tp_size: 3\n")
    err = one_line_error(capsys, ["launch", "--config_file", str(cfg), "train.py"])
    assert f"tp_size 3 (config file {cfg}: parallelism_config.parallelism_config_tp_size)" in err, err
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "4")
    err = one_line_error(capsys, ["launch", "--cpu", "--num_processes", "2", "train.py"])
    assert "sp_size 4 (environment PARALLELISM_CONFIG_SP_SIZE)" in err and "runs 2" in err, err


def test_layouts_that_fit_are_accepted(cli):
    assert plan_for("--cpu", "--num_processes", "2", "--parallelism_config_tp_size", "2", "train.py").num_processes == 2
    four = plan_for("--cpu", "--num_processes", "4", "--parallelism_config_dp_shard_size", "2",
                    "--parallelism_config_tp_size", "2", "train.py")
    assert four.child_env["PARALLELISM_CONFIG_TP_SIZE"] == "2"
    # All sizes 1 on several processes: nothing asked, the strategy's default layout (as the ranks decide).
    plan_for("--cpu", "--num_processes", "2", "--use_parallelism_config", "train.py")
    plan_for("--cpu", "--num_processes", "2", "--parallelism_config_tp_size", "1", "train.py")
    # The count is over all machines (Accelerate's num_processes).
    plan_for("--cpu", "--num_machines", "2", "--main_process_ip", "1.2.3.4", "--num_processes", "4",
             "--parallelism_config_tp_size", "4", "train.py")
    # dp_replicate alone (plain replication) fits by its product.
    plan_for("--cpu", "--num_processes", "2", "--parallelism_config_dp_replicate_size", "2", "train.py")
    # Context parallelism runs on the CPU (torch's ring with the CPU kernel); sequence parallelism anywhere.
    plan_for("--cpu", "--num_processes", "2", "--parallelism_config_cp_size", "2", "train.py")
    sp = plan_for("--cpu", "--num_processes", "4", "--parallelism_config_dp_replicate_size", "2",
                  "--parallelism_config_sp_size", "2", "train.py")
    assert sp.child_env["PARALLELISM_CONFIG_SP_SIZE"] == "2"


def test_real_command_starts_nothing_and_imports_no_torch(tmp_path):
    """The real `hasten launch`: exit 2, one line, and the script never ran (it would write a file)."""
    env = clean_env(tmp_path / "absent.yaml", CUDA_VISIBLE_DEVICES="")
    for sizes in (["--parallelism_config_tp_size", "3"], ["--parallelism_config_sp_size", "3"]):
        rc, out, err, _ = hasten(["launch", "--cpu", "--num_processes", "2", *sizes, script("launch_env.py"),
                                  tmp_path], env, timeout=60)
        assert rc == 2, (rc, out, err)
        assert err.startswith("hasten: error: ") and err.strip().count("\n") == 0 and "Traceback" not in err, err
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".json")], "a process started"
    code = ("import sys\nfrom hasten.commands.cli import main\n"
            "argv = ['launch', '--cpu', '--num_processes', '2', '--parallelism_config_tp_size', '3', 'x.py']\n"
            "assert main(argv) == 2\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
            "print('ok')\n")
    (tmp_path / "x.py").write_text("")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


# -- item 11: a save that fails on one process only -------------------------------------------
AGREE_TIMEOUT = 150  # a rank left in a collective would wait for the group's 120 s timeout


def _run_ranks(tmp_path, checks, machines=1):
    """2 real gloo processes running ``checks`` of tests/checks_agree.py; ``machines=2``: one process per
    'machine' (torchrun's variables as two nodes would set them). Returns the report."""
    import json
    import time

    from devices import process_env
    from distributed import HERE, free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, **process_env(2))
        env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   HASTEN_TEST_TMP=str(tmp_path), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([HERE, env.get("PYTHONPATH", "")]))
        if machines == 2:
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
        else:
            env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        log = open(tmp_path / f"log{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "distributed.py"), "checks_agree",
                                       str(tmp_path), str(rank), *checks], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=HERE))
    deadline = time.monotonic() + AGREE_TIMEOUT
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    out = []
    for rank in range(2):
        path, seen = tmp_path / f"rank{rank}.jsonl", {}
        if path.exists():
            seen = {item["name"]: item for item in map(json.loads, path.read_text().splitlines())}
        log = (tmp_path / f"log{rank}.txt").read_text()
        for name in checks:
            assert name in seen, f"rank {rank} never finished {name} (left in a collective?); log:\n{log[-3000:]}"
            assert seen[name]["ok"], f"{name} failed on rank {rank}:\n{seen[name]['error']}"
        out.append({name: seen[name]["value"] for name in checks})
    return out


def _same_error(values, *fragments):
    assert values[0]["error"] == values[1]["error"], values
    error = values[0]["error"]
    for fragment in fragments:
        assert fragment in error, (fragment, error)
    return values[0]


def test_one_process_failing_its_save_makes_every_process_raise_the_same_error(tmp_path):
    checks = ["check_save_state_folder_fails_on_rank_1_with_a_collective_hook",
              "check_save_model_of_user_sharded_model_fails_on_the_writer",
              "check_save_model_of_user_sharded_model_write_fails_midway"]
    ranks = _run_ranks(tmp_path, checks)
    hook = _same_error([r[checks[0]] for r in ranks], "process 1:", "injected")
    assert hook["left"] == [], hook  # nothing committed, no temporary folder left
    _same_error([r[checks[1]] for r in ranks], "process 0:", "injected", "weights")
    midway = [r[checks[2]] for r in ranks]
    _same_error(midway, "process 0:", "injected", "model-00002-of-00003.safetensors")
    assert [m["files"] for m in midway] == [2, 0]  # the writer stopped writing at its failure; the others never write


def test_one_node_failing_its_folder_makes_every_process_raise_the_same_error(tmp_path):
    check = "check_save_state_node_folder_fails_on_one_node"
    ranks = _run_ranks(tmp_path, [check], machines=2)
    value = _same_error([r[check] for r in ranks], "process 1:", "injected", "-node1")
    assert value["left"] == [], value


def test_save_hooks_held_by_one_process_only_keep_the_agreements_paired(tmp_path):
    check = "check_save_hooks_held_by_one_process_only"
    ranks = [r[check] for r in _run_ranks(tmp_path, [check])]
    assert [r["calls"] for r in ranks] == [["first", "second", "first"], []], ranks
    assert ranks[0]["first_save"] == ranks[1]["first_save"] == ["checkpoint_0"], ranks
    value = _same_error(ranks, "process 0:", "injected")
    assert value["left"] == ["checkpoint_0"], value  # the failed save left nothing; the first one stays
