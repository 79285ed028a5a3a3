"""Whole-process import cost: `import hasten` against `import torch` (and Accelerate if installed).

    python bench/import_time.py [--runs 15]

Each variant is a fresh interpreter; variants are interleaved run by run and the median wall time
is reported, with the ratio to `import torch`. Accelerate's own gate is 1.2x; ours is 1.05x.
"""

import argparse
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "python (empty)": "pass",
    "import torch": "import torch",
    "import hasten": "import hasten",
    "from hasten import Accelerator": "from hasten import Accelerator",
    "import accelerate": "import accelerate",
    "from accelerate import Accelerator": "from accelerate import Accelerator",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    variants = dict(VARIANTS)
    try:
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ImportError
    except ImportError:
        variants = {k: v for k, v in variants.items() if "accelerate" not in v}
    times = {k: [] for k in variants}
    for _ in range(args.runs):
        for name, code in variants.items():
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times[name].append(time.perf_counter() - t0)
    torch_median = statistics.median(times["import torch"])
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"{name:36s} {med * 1000:7.0f} ms   {med / torch_median:5.3f}x import torch")


if __name__ == "__main__":
    main()
