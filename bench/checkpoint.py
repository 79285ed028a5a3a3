"""Checkpoint speed: save_state/load_state vs plain safetensors, and resume seek time.

    python bench/checkpoint.py                    # ~200 MB model + Adam state, 6 interleaved rounds
    python bench/checkpoint.py --rounds 9 --mb 200 --dir /path/on/the/disk/to/test
    python bench/checkpoint.py --compare --mb 300   # hasten vs torch.save + fsync vs Accelerate
    python bench/checkpoint.py --verify --rounds 7  # cost of load_state's default checksums

Throughput: one process trains a ~200 MB model (fp32 Linear layers) one step with Adam, so the
optimizer holds two more copies (~600 MB in all). Each round runs the saves, then the loads, each
group in rotating order:
  * safetensors save: ``save_file`` of the model's state dict and of the optimizer's tensors (no
    fsync, no manifest: what a hand-written checkpoint does), and the same followed by an fsync of
    both files (the durability that hasten's save gives);
  * hasten save: ``accelerator.save_state`` (fsync of every file, checksums, manifest, atomic rename);
  * hasten save, blocking=False: ``save_state(blocking=False)`` timed until it returns (the state is
    copied into host buffers kept from the previous save, the loop may go on) and until the
    background thread has committed the checkpoint (``wait_for_checkpoint``);
  * safetensors load: ``load_file`` of both files and copying every tensor into the live model and
    optimizer (``load_file`` alone only maps the file; the copy is the actual reading);
  * hasten load: ``accelerator.load_state`` (verifies the manifest, file sizes and checksums
    first, then restores the same tensors plus the small states), and with ``verify="checksum"``
    (the same: checksums are the default);
Every save writes fresh files (the previous copy is deleted outside the timing, as when automatic
naming starts a new folder and retention deletes old ones in the background). hasten writes big
files past the page cache (O_DIRECT), so before each load from the page cache both folders are
read once, untimed. The two default loads run again after evicting the files from the page cache (``posix_fadvise``),
i.e. reading from the disk as a resumed job on another node would. Before each timed operation the
disk is quiesced (``os.sync()``, deletions of replaced checkpoints finished), so one operation's
writeback does not slow the next one down. Medians over rounds are reported
with MB/s and the hasten / safetensors throughput ratio.

Seek: a prepared loader over 1,000,000 shuffled indices (31,250 batches of 32) is resumed at 1 %,
50 %, 90 % and 99 % of the epoch; the time from ``load_state_dict`` to the first batch is reported
(median of 5). Resuming costs one permutation wherever it lands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time


def _evict(folder: str) -> None:
    for directory, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_all(folder: str) -> None:
    for directory, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                while f.read(64 << 20):
                    pass


SETTLE = 0.0


def _quiesce() -> None:
    """Start every timed operation on a quiet disk: no dirty pages, no deletion still running."""
    from hasten.checkpointing.layout import wait_for_deletions

    wait_for_deletions()
    os.sync()
    time.sleep(SETTLE)  # a virtual disk keeps writing back after sync() returns


def throughput(rounds: int, mb: int, base: str) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from hasten import Accelerator

    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(mb * 2**20 / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    acc = Accelerator(cpu=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    opt_tensors = {f"{pid}.{k}": v for pid, s in opt.state_dict()["state"].items() for k, v in s.items()
                   if torch.is_tensor(v) and v.dim() > 0}
    total = model_bytes + sum(v.numel() * v.element_size() for v in opt_tensors.values())
    live_model = dict(model.state_dict())
    plain, ours, ours_bg = (os.path.join(base, name) for name in ("plain", "ours", "ours_bg"))
    os.makedirs(plain, exist_ok=True)

    def plain_save():
        save_file(dict(model.state_dict()), os.path.join(plain, "model.safetensors"))
        save_file(opt_tensors, os.path.join(plain, "optimizer.safetensors"))

    def plain_save_fsync():
        plain_save()
        for name in ("model.safetensors", "optimizer.safetensors"):
            fd = os.open(os.path.join(plain, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def plain_load():
        weights = load_file(os.path.join(plain, "model.safetensors"))
        moments = load_file(os.path.join(plain, "optimizer.safetensors"))
        with torch.no_grad():
            for k, v in weights.items():
                live_model[k].copy_(v)
            for k, v in moments.items():
                opt_tensors[k].copy_(v)

    def ours_save():
        acc.save_state(ours)

    committed: list = []

    def ours_save_background():
        start = time.perf_counter()
        acc.save_state(ours_bg, blocking=False)
        returned = time.perf_counter()
        acc.wait_for_checkpoint()
        committed.append(time.perf_counter() - start)
        return returned - start

    def ours_load():
        acc.load_state(ours)

    def ours_load_checksums():
        acc.load_state(ours, verify="checksum")

    plain_save(), ours_save(), ours_save_background()  # warm-up (first write of the files)
    committed.clear()
    runs = {"safetensors save": plain_save, "safetensors save + fsync": plain_save_fsync, "hasten save": ours_save,
            "hasten save, blocking=False": ours_save_background,
            "safetensors load": plain_load,
            "hasten load": ours_load, "hasten load, verify=checksum": ours_load_checksums}
    cold = (("safetensors load (cold)", plain_load, plain), ("hasten load (cold)", ours_load, ours))
    times: dict = {k: [] for k in list(runs) + [c[0] for c in cold]}
    saves = [k for k in runs if "save" in k]
    loads = [k for k in runs if "load" in k]
    for r in range(rounds):  # each group rotates, so every operation runs first, second... equally often
        for group in (saves, loads):
            for name in group[r % len(group):] + group[:r % len(group)]:
                # Every save writes fresh files: the previous ones are deleted first, outside the timing
                # (overwriting costs the filesystem's freeing of the old blocks, on this VM's disk
                # mounted with "discard" ~0.3 s for 600 MB, and would blur the comparison).
                if name.startswith("safetensors save"):
                    for old in os.listdir(plain):
                        os.remove(os.path.join(plain, old))
                elif name.startswith("hasten save"):
                    shutil.rmtree(ours_bg if "blocking=False" in name else ours, ignore_errors=True)
                elif "load" in name:  # "from the page cache" for both: hasten writes big files past it
                    _read_all(plain if name.startswith("safetensors") else ours)
                _quiesce()
                start = time.perf_counter()
                returned = runs[name]()  # the background save times itself: until it returns
                times[name].append(returned if returned is not None else time.perf_counter() - start)
        for name, fn, folder in cold:
            _quiesce()
            _evict(folder)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    times["hasten save, blocking=False, until committed"] = committed
    out = {"bytes": total, "rounds": rounds, "median_s": {k: statistics.median(v) for k, v in times.items()},
           "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()}}
    med = out["median_s"]
    out["MB_per_s"] = {k: total / 2**20 / v for k, v in med.items()}
    out["ratio"] = {
        "save": med["safetensors save"] / med["hasten save"],
        "save vs save + fsync": med["safetensors save + fsync"] / med["hasten save"],
        "save, blocking=False": med["safetensors save"] / med["hasten save, blocking=False"],
        "save, blocking=False, until committed": med["safetensors save"] / med["hasten save, blocking=False, until committed"],
        "load": med["safetensors load"] / med["hasten load"],
        "load, verify=checksum": med["safetensors load"] / med["hasten load, verify=checksum"],
        "load (cold)": med["safetensors load (cold)"] / med["hasten load (cold)"],
    }
    return out


def compare(rounds: int, mb: int, base: str) -> dict:
    """hasten vs plain ``torch.save`` + fsync vs Accelerate (when installed), each on its own copy of
    the same model + Adam state, interleaved: every round runs each save, then each load, in a
    rotating order. Loads read from the page cache (every folder is read once, untimed, first)."""
    import torch

    from hasten import Accelerator

    width = 2048
    layers = max(1, round(mb * 2**20 / (width * width * 4)))

    def trained(prepare):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = prepare(model, opt)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    ours = Accelerator(cpu=True)
    model, opt = trained(ours.prepare)
    raw_model, raw_opt = trained(lambda m, o: (m, o))
    folders = {k: os.path.join(base, k) for k in ("raw", "hasten", "hasten_bg", "accelerate")}
    raw_file = os.path.join(folders["raw"], "state.pt")

    def raw_save():
        os.makedirs(folders["raw"], exist_ok=True)
        torch.save({"model": raw_model.state_dict(), "optimizer": raw_opt.state_dict()}, raw_file)
        fd = os.open(raw_file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_load():
        state = torch.load(raw_file, weights_only=True)
        raw_model.load_state_dict(state["model"])
        raw_opt.load_state_dict(state["optimizer"])

    def background_return():
        start = time.perf_counter()
        ours.save_state(folders["hasten_bg"], blocking=False)
        returned = time.perf_counter() - start
        ours.wait_for_checkpoint()
        return returned

    saves = {"torch.save + fsync": raw_save, "hasten save": lambda: ours.save_state(folders["hasten"]),
             "hasten save, blocking=False (return)": background_return}
    loads = {"torch.load": raw_load, "hasten load": lambda: ours.load_state(folders["hasten"])}
    try:
        import accelerate
    except ImportError:
        print("accelerate is not installed: compared with torch.save/torch.load only")
    else:
        theirs = accelerate.Accelerator(cpu=True)
        their_model, their_opt = trained(theirs.prepare)
        saves["accelerate save_state (no fsync)"] = lambda: theirs.save_state(folders["accelerate"])
        loads["accelerate load_state"] = lambda: theirs.load_state(folders["accelerate"])
    writes = dict(zip(saves, (folders["raw"], folders["hasten"], folders["hasten_bg"], folders["accelerate"])))
    for fn in list(saves.values()):  # warm-up: first writes, first staging
        fn()
    times: dict = {k: [] for k in list(saves) + list(loads)}
    for r in range(rounds):
        for group in (saves, loads):
            names = list(group)
            for name in names[r % len(names):] + names[:r % len(names)]:
                if group is saves:  # fresh files for every save, the old ones deleted untimed
                    shutil.rmtree(writes[name], ignore_errors=True)
                else:
                    for folder in folders.values():
                        if os.path.isdir(folder):
                            _read_all(folder)
                _quiesce()
                start = time.perf_counter()
                returned = group[name]()
                times[name].append(returned if isinstance(returned, float) else time.perf_counter() - start)
    total = sum(p.numel() * 4 * 3 for p in model.parameters())
    return {"bytes": total, "rounds": rounds,
            "min_s": {k: min(v) for k, v in times.items()},
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()}}


def seek(samples: int = 1_000_000, batch: int = 32) -> dict:
    import torch

    from hasten.data_loader import prepare_data_loader

    class Indices(torch.utils.data.Dataset):
        def __len__(self):
            return samples

        def __getitem__(self, i):
            return i

    dl = prepare_data_loader(torch.utils.data.DataLoader(Indices(), batch_size=batch, shuffle=True), data_seed=0)
    steps = len(dl)
    out = {}
    for fraction in (0.01, 0.5, 0.9, 0.99):
        at = int(steps * fraction)
        times = []
        for _ in range(5):
            dl.load_state_dict({"epoch": 3, "batches_yielded": at})
            start = time.perf_counter()
            next(iter(dl))
            times.append(time.perf_counter() - start)
        out[f"{fraction:.0%}"] = statistics.median(times)
    return {"batches_per_epoch": steps, "seconds_to_first_batch": out}


def verify_cost(rounds: int, mb: int, base: str) -> dict:
    """``load_state`` with its default verification (sizes and checksums of every file) against
    ``verify="size"`` (sizes only), alternating in every round, from the page cache and cold."""
    import torch

    from hasten import Accelerator

    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(mb * 2**20 / (width * width * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    acc = Accelerator(cpu=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    folder = acc.save_state(os.path.join(base, "ours"))
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(folder) for n in ns)
    runs = {"verified": lambda: acc.load_state(folder), "sizes only": lambda: acc.load_state(folder, verify="size")}
    times: dict = {f"{k}{c}": [] for k in runs for c in ("", " (cold)")}
    for name in runs:  # warm-up
        runs[name]()
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for cold in ("", " (cold)"):
            for name in order:
                _quiesce()
                if cold:
                    _evict(folder)
                else:
                    _read_all(folder)
                start = time.perf_counter()
                runs[name]()
                times[name + cold].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": total, "rounds": rounds, "median_s": med, "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "ratio": {"page cache": med["verified"] / med["sizes only"],
                      "cold": med["verified (cold)"] / med["sizes only (cold)"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="each group of operations rotates its order every round")
    parser.add_argument("--mb", type=int, default=200, help="model size in MB (Adam adds twice as much)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds to wait after sync() before each timed operation (default 1)")
    parser.add_argument("--compare", action="store_true",
                        help="hasten vs torch.save + fsync vs Accelerate save/load instead of the default runs")
    parser.add_argument("--verify", action="store_true",
                        help="only the cost of load_state's default verification (checksums) vs verify='size'")
    args = parser.parse_args()
    global SETTLE
    SETTLE = args.settle
    base = tempfile.mkdtemp(prefix="hasten-bench-ckpt-", dir=args.dir)
    if args.verify:
        try:
            result = verify_cost(args.rounds, args.mb, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"checkpoint: {result['bytes'] / 2**20:.0f} MiB (model + Adam), {result['rounds']} interleaved rounds")
        for name, seconds in result["median_s"].items():
            print(f"  load_state, {name:22s} {seconds:7.3f} s")
        for name, ratio in result["ratio"].items():
            print(f"  verified / sizes only, {name:12s} {ratio:5.2f}x")
        print(json.dumps(result))
        return
    if args.compare:
        try:
            result = compare(args.rounds, args.mb, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print(f"state: {result['bytes'] / 2**20:.0f} MiB (model + AdamW), {result['rounds']} interleaved rounds")
        print(f"  {'operation':40s} {'min':>8s} {'median':>8s}")
        for name in result["median_s"]:
            print(f"  {name:40s} {result['min_s'][name]:7.3f}s {result['median_s'][name]:7.3f}s")
        print(json.dumps(result))
        return
    try:
        result = {"throughput": throughput(args.rounds, args.mb, base), "seek": seek()}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    t = result["throughput"]
    print(f"state: {t['bytes'] / 2**20:.0f} MiB (model + Adam), {t['rounds']} rounds, medians")
    for name, seconds in t["median_s"].items():
        print(f"  {name:28s} {seconds:7.3f} s  {t['MB_per_s'][name]:7.0f} MiB/s")
    for name, ratio in t["ratio"].items():
        print(f"  hasten / safetensors throughput, {name:20s} {ratio:5.2f}x")
    s = result["seek"]
    print(f"seek ({s['batches_per_epoch']} batches per epoch), time to the first batch after resuming at:")
    for where, seconds in s["seconds_to_first_batch"].items():
        print(f"  {where:>4s}  {seconds * 1000:7.1f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
