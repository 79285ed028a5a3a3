"""A port ``hasten launch`` picked itself but another program bound before the rendezvous did (a busy
machine, a concurrent ``torchrun --standalone``): the launch picks another and runs, instead of dying
with EADDRINUSE or joining the other program's store. A port the user named is never changed."""

import os
import subprocess
import sys
import textwrap

from scripts.launch_common import clean_env

# Plan the launch, then let "another program" host a TCP store on the picked port before the agent binds.
DRIVER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from torch.distributed import TCPStore
    from hasten.commands.launch import build_plan, launch_command_parser
    from hasten.commands.elastic import run_elastic

    args = launch_command_parser().parse_args(["--cpu", "--num_processes", "2", *sys.argv[2:], sys.argv[1]])
    plan = build_plan(args)
    other = TCPStore("127.0.0.1", plan.main_port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    other.set("owner", "another program")
    print("HELD", plan.main_port, plan.port_picked, flush=True)
    status = run_elastic(plan)
    assert other.get("owner") == b"another program" and not other.check(["torchelastic/hasten"])
    sys.exit(status)
""")

WORKER = textwrap.dedent("""
    import os, torch.distributed as dist
    dist.init_process_group("gloo")
    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    print(f"RANK {dist.get_rank()} PORT {os.environ['MASTER_PORT']} SUM {int(t.item())}", flush=True)
    dist.destroy_process_group()
""")


def _run(tmp_path, *flags):
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "worker.py").write_text(WORKER)
    env = clean_env(tmp_path / "none.yaml", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "worker.py"), *flags],
                          env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)


def test_a_picked_port_taken_before_the_rendezvous_binds_is_replaced(tmp_path):
    proc = _run(tmp_path, "--tee", "3")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    held = int(next(line.split()[1] for line in out.splitlines() if line.startswith("HELD")))
    assert "HELD %d True" % held in out
    lines = [line for line in out.splitlines() if "SUM 2" in line]
    assert len(lines) == 2, out  # both processes ran and met, on a port that is not the taken one
    assert all(f"PORT {held}" not in line for line in lines), out


def test_a_port_the_user_named_is_not_replaced_when_taken(tmp_path):
    port = 29000 + os.getpid() % 5000
    proc = _run(tmp_path, "--main_process_port", str(port))
    out = proc.stdout + proc.stderr
    assert f"HELD {port} False" in out, out
    assert proc.returncode == 1, out
    assert f"port {port} was taken by another program" in out and "SUM 2" not in out, out
