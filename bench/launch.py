"""Whole-process wall time of `hasten launch` against `torchrun` on the same 2-process job.

    python bench/launch.py                 # trivial script (prints its rank), 10 interleaved rounds
    python bench/launch.py --script gloo   # each process imports torch and all-reduces over gloo
    python bench/launch.py --help-times    # also time `hasten --help` / `hasten launch --help`

Both commands are run from the same environment's bin folder (no shims), one after the other in
each round so that machine load affects both alike; the report gives medians and min/max.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPTS = {
    "trivial": 'import os\nprint("rank", os.environ["RANK"], flush=True)\n',
    "gloo": (
        "import torch, torch.distributed as dist\n"
        'dist.init_process_group("gloo")\n'
        "t = torch.ones(1)\ndist.all_reduce(t)\n"
        "assert t.item() == dist.get_world_size()\n"
        "dist.destroy_process_group()\n"
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def summary(name: str, times: list[float]) -> str:
    return (f"{name:<34} median {statistics.median(times):6.3f} s   min {min(times):6.3f}   max {max(times):6.3f}"
            f"   (n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="trivial")
    parser.add_argument("--help-times", action="store_true")
    opts = parser.parse_args()

    bindir = os.path.dirname(sys.executable)
    hasten, torchrun = os.path.join(bindir, "hasten"), os.path.join(bindir, "torchrun")
    for exe in (hasten, torchrun):
        if not os.path.exists(exe):
            raise SystemExit(f"{exe} not found; install hasten (pip install -e .) in this environment")
    work = tempfile.mkdtemp(prefix="hasten-bench-")
    script = os.path.join(work, f"{opts.script}.py")
    with open(script, "w") as f:
        f.write(SCRIPTS[opts.script])
    env = dict(os.environ, HASTEN_CONFIG_FILE=os.path.join(work, "no-config.yaml"))
    env.pop("OMP_NUM_THREADS", None)  # both launchers then apply their own default

    results: dict[str, list[float]] = {"hasten launch": [], "torchrun": []}
    timed([hasten, "launch", "--num_processes", str(opts.nproc), script], env)  # warm the file cache
    for i in range(opts.rounds):
        pair = [
            ("hasten launch", [hasten, "launch", "--num_processes", str(opts.nproc), script]),
            ("torchrun", [torchrun, "--nproc_per_node", str(opts.nproc), "--master_port", str(free_port()), script]),
        ]
        if i % 2:
            pair.reverse()  # alternate who goes first
        for name, cmd in pair:
            results[name].append(timed(cmd, env))
    print(f"{opts.nproc} processes, script '{opts.script}', {opts.rounds} interleaved rounds, "
          f"{os.cpu_count()} CPU(s), python {sys.version.split()[0]}")
    for name, times in results.items():
        print(summary(name, times))
    ratio = statistics.median(results["hasten launch"]) / statistics.median(results["torchrun"])
    print(f"hasten launch / torchrun (median): {ratio:.2f}")
    if opts.help_times:
        for cmd in ([hasten, "--help"], [hasten, "launch", "--help"], [hasten, "config", "--help"]):
            times = [timed(cmd, env) for _ in range(opts.rounds)]
            print(summary(" ".join([os.path.basename(cmd[0])] + cmd[1:]), times))


if __name__ == "__main__":
    main()
