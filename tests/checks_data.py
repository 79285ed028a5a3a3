"""Checks of prepared dataloaders and gather_for_metrics, run inside each rank (see distributed.py).

Each check returns JSON-able values; the assertions that need both ranks' values live in
test_data_loader.py, the others are made here.
"""

import itertools

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hasten.data_loader import gather_for_metrics, prepare_data_loader, skip_first_batches
from hasten.state import GradientState, PartialState
from hasten.utils.operations import gather_object, send_to_device


class Stream(IterableDataset):
    """0 .. n-1 as a stream (an iterable dataset without a length)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Counting(Dataset):
    """A map-style dataset that counts reads (to prove skipping reads nothing)."""

    def __init__(self, n):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return i


class Records(Dataset):
    """Samples as dicts with a tensor and a string."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i), -float(i)]), "name": f"s{i}"}


def _batches(dl):
    return [b.tolist() for b in dl]


def _world():
    s = PartialState()
    return s.num_processes, s.process_index


def _dev(data):
    """``data`` on this rank's device: these loaders keep batches on CPU (no ``put_on_device``), and NCCL
    moves CUDA tensors only, so a gathered batch goes to the device first, as in a training script."""
    return send_to_device(data, PartialState().device)


# -- sharding ---------------------------------------------------------------------------------------
def check_sharding_layouts():
    """Per-rank batches of range(10) in the basic layouts (compared in the test)."""
    n, _ = _world()
    out = {}
    for name, bs, kw in [("plain", 3, {}), ("uneven", 3, {"even_batches": False}),
                         ("split", 4, {"split_batches": True}),
                         ("split_uneven", 4, {"split_batches": True, "even_batches": False}),
                         ("drop_last", 3, {"drop_last": True})]:
        drop = kw.pop("drop_last", False)
        dl = prepare_data_loader(DataLoader(list(range(10)), batch_size=bs, drop_last=drop), **kw)
        out[name] = {"batches": _batches(dl), "len": len(dl)}
    try:
        prepare_data_loader(DataLoader(list(range(10)), batch_size=3), split_batches=True, num_processes=2)
        out["split_error"] = None
    except ValueError as err:
        out["split_error"] = str(err)
    return out


def check_custom_samplers_survive():
    class Backwards(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))

        def __len__(self):
            return self.n

    class Growing(torch.utils.data.Sampler):
        """Batches of sizes 1, 2, 3, ... over range(n)."""

        def __init__(self, n):
            self.n = n

        def __iter__(self):
            start, size = 0, 1
            while start < self.n:
                yield list(range(start, min(self.n, start + size)))
                start, size = start + size, size + 1

        def __len__(self):
            count, start, size = 0, 0, 1
            while start < self.n:
                count, start, size = count + 1, start + size, size + 1
            return count

    sampler = Backwards(8)
    dl = prepare_data_loader(DataLoader(list(range(8)), batch_size=2, sampler=sampler))
    assert dl.sampler is sampler, dl.sampler
    batch_sampler = Growing(10)
    dl2 = prepare_data_loader(DataLoader(list(range(10)), batch_sampler=batch_sampler), even_batches=False)
    assert dl2.batch_sampler.batch_sampler is batch_sampler
    collected = []
    for batch in dl2:
        collected += gather_for_metrics(_dev(batch)).tolist()
    assert sorted(collected) == list(range(10)), collected
    return {"backwards": _batches(dl), "growing": _batches(dl2)}


def check_shuffle_agrees_and_changes():
    n, rank = _world()
    torch.manual_seed(1000 + rank)  # ranks disagree on purpose: prepare must agree on a seed
    dl = prepare_data_loader(DataLoader(list(range(12)), batch_size=2, shuffle=True))
    epochs = []
    for _ in range(3):
        mine = [i for b in dl for i in b.tolist()]
        epochs.append([mine] if n == 1 else gather_object([mine]))
    # set_epoch(e) repeating epoch e is the seedable sampler's promise (seed + epoch, as Accelerate's);
    # the default shuffle draws a new order per pass, as a plain DataLoader does.
    seedable = prepare_data_loader(DataLoader(list(range(12)), batch_size=2, shuffle=True), use_seedable_sampler=True)
    seedable_epochs = [[i for b in seedable for i in b.tolist()] for _ in range(2)]
    seedable.set_epoch(1)
    again = [i for b in seedable for i in b.tolist()]
    seeded = [prepare_data_loader(DataLoader(list(range(12)), batch_size=2, shuffle=True), data_seed=7,
                                  use_seedable_sampler=True) for _ in range(2)]
    runs = [[i for b in d for i in b.tolist()] for d in seeded]
    gen = torch.Generator().manual_seed(5)
    with_gen = prepare_data_loader(DataLoader(list(range(12)), batch_size=2, shuffle=True, generator=gen))
    return {"epochs": epochs, "epoch1_again": again, "seedable_epoch1": seedable_epochs[1], "seeded": runs,
            "own_generator": with_gen.sampler.generator is gen}


def check_iterable_shard_no_duplicates():
    n, _ = _world()
    out = {}
    for length, bs, split in [(11, 2, False), (8, 2, False), (11, 4, True), (3, 4, False)]:
        dl = prepare_data_loader(DataLoader(Stream(length), batch_size=bs), split_batches=split)
        out[f"{length}-{bs}-{split}"] = _batches(dl)
    return out


def check_dispatch_matches_sharding():
    """dispatch_batches gives every rank the batches the sharded path gives it."""
    configs = [dict(n=10, bs=3), dict(n=10, bs=3, even_batches=False), dict(n=10, bs=4, split_batches=True),
               dict(n=9, bs=4, split_batches=True, even_batches=False), dict(n=7, bs=2),
               dict(n=1, bs=3, even_batches=False), dict(n=12, bs=2)]
    report = []
    for cfg in configs:
        cfg = dict(cfg)
        n, bs = cfg.pop("n"), cfg.pop("bs")
        for iterable in (False, True):
            if iterable and cfg.get("even_batches") is False:
                continue  # sharded iterable datasets always complete the last group
            make = (lambda: DataLoader(Stream(n), batch_size=bs)) if iterable else \
                (lambda: DataLoader(list(range(n)), batch_size=bs))
            sharded = _batches(prepare_data_loader(make(), **cfg))
            dispatched_dl = prepare_data_loader(make(), dispatch_batches=True, put_on_device=True,
                                                device=PartialState().device, **cfg)
            dispatched = _batches(dispatched_dl)
            assert sharded == dispatched, (n, bs, cfg, iterable, sharded, dispatched)
            if not iterable:
                assert len(dispatched_dl) == len(dispatched), (len(dispatched_dl), dispatched)
            report.append([n, bs, sorted(cfg.items()), iterable, len(dispatched)])
    return report


class _NeverRead(Dataset):
    """Dispatch: ranks other than 0 must never read the dataset."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if PartialState().process_index != 0:
            raise AssertionError(f"process {PartialState().process_index} read sample {i}")
        return {"x": torch.tensor(i), "tag": f"t{i}"}


def check_dispatch_only_main_reads():
    dl = prepare_data_loader(DataLoader(_NeverRead(), batch_size=2), dispatch_batches=True, put_on_device=True,
                             device=PartialState().device)
    got = [(b["x"].tolist(), b["tag"]) for b in dl]
    return got


def check_device_and_end_of_dataloader():
    dl = prepare_data_loader(DataLoader([{"a": torch.tensor(i), "b": [torch.tensor(i)]} for i in range(9)],
                                        batch_size=2), put_on_device=True, device=torch.device("meta"))
    gs = GradientState()
    flags, devices = [], set()
    for batch in dl:
        flags.append(gs.end_of_dataloader)
        devices |= {batch["a"].device.type, batch["b"][0].device.type}
        assert gs.active_dataloader is dl
    assert gs.active_dataloader is None and not gs.in_dataloader
    for _ in dl:  # a break removes the loader too
        break
    assert gs.active_dataloader is None, gs.active_dataloader
    try:
        for _ in dl:
            raise KeyError("boom")
    except KeyError:
        pass
    assert gs.active_dataloader is None
    # nested loaders: the inner one is active inside, the outer one again after it
    outer = prepare_data_loader(DataLoader(list(range(8)), batch_size=2))
    inner = prepare_data_loader(DataLoader(list(range(4)), batch_size=1))
    for _ in outer:
        for _ in inner:
            assert gs.active_dataloader is inner
        assert gs.active_dataloader is outer
    return {"flags": flags, "devices": sorted(devices), "len": len(dl)}


def check_skip_first_batches():
    counting = Counting(20)
    dl = prepare_data_loader(DataLoader(counting, batch_size=2))
    full = _batches(dl)
    reads_full = counting.reads
    skipped = skip_first_batches(dl, 2)
    counting.reads = 0
    rest = _batches(skipped)
    assert rest == full[2:], (rest, full)
    assert counting.reads == sum(len(b) for b in rest), counting.reads  # nothing read for skipped batches
    assert len(skipped) == len(rest)
    it = _batches(skip_first_batches(prepare_data_loader(DataLoader(Stream(11), batch_size=2)), 1))
    it_full = _batches(prepare_data_loader(DataLoader(Stream(11), batch_size=2)))
    assert it == it_full[1:], (it, it_full)
    disp = prepare_data_loader(DataLoader(list(range(11)), batch_size=2), dispatch_batches=True, put_on_device=True,
                               device=PartialState().device)
    disp_full = _batches(disp)
    assert _batches(skip_first_batches(disp, 2)) == disp_full[2:]
    return {"full": full, "reads_full": reads_full}


def check_resume_state_dict():
    dl = prepare_data_loader(DataLoader(list(range(20)), batch_size=2, shuffle=True), data_seed=3,
                                    use_seedable_sampler=True)
    _ = _batches(dl)  # epoch 0
    seen, state = [], None
    for i, batch in enumerate(dl):  # epoch 1, interrupted after 2 batches
        seen.append(batch.tolist())
        if i == 1:
            state = dl.state_dict()
            break
    fresh = prepare_data_loader(DataLoader(list(range(20)), batch_size=2, shuffle=True), data_seed=3,
                                    use_seedable_sampler=True)
    fresh.load_state_dict(state)
    rest = _batches(fresh)
    reference = prepare_data_loader(DataLoader(list(range(20)), batch_size=2, shuffle=True), data_seed=3,
                                    use_seedable_sampler=True)
    reference.set_epoch(1)
    whole = _batches(reference)
    assert seen + rest == whole, (seen, rest, whole)
    assert fresh.iteration == 2
    return state


# -- gather_for_metrics -----------------------------------------------------------------------------
def _loop(dl, transform=lambda b: b, **kw):
    collected = []
    for batch in dl:
        out = gather_for_metrics(_dev(transform(batch)), **kw)
        collected.extend(out.tolist() if isinstance(out, torch.Tensor) else out)
    return collected


def check_gather_for_metrics_grid():
    """Every length 1..13 x batch size 1..4 x even on/off x map/iterable: exactly the dataset."""
    failures, count = [], 0
    for n, bs, even, iterable in itertools.product(range(1, 14), range(1, 5), (True, False), (False, True)):
        count += 1
        data = Stream(n) if iterable else list(range(n))
        dl = prepare_data_loader(DataLoader(data, batch_size=bs), even_batches=even)
        try:
            got = _loop(dl)
        except Exception as err:  # noqa: BLE001 - report the configuration
            got = repr(err)
        if not isinstance(got, list) or sorted(got) != list(range(n)):
            failures.append({"n": n, "bs": bs, "even": even, "iterable": iterable, "got": got})
    return {"count": count, "failures": failures}


def check_gather_for_metrics_variants():
    """split_batches, dispatch_batches, objects and dicts over a sample of the grid."""
    world, _ = _world()
    failures, count = [], 0
    lengths = (1, 2, 3, 5, 7, 8, 11, 13)
    for n, bs, even, iterable, split, dispatch, kind in itertools.product(
            lengths, (2, 4), (True, False), (False, True), (False, True), (False, True), ("tensor", "dict", "objects")):
        if (split, dispatch).count(True) + (kind != "tensor") > 1:
            continue  # one variant at a time keeps the launch short
        count += 1
        data = Stream(n) if iterable else list(range(n))
        extra = dict(dispatch_batches=True, put_on_device=True, device=PartialState().device) if dispatch else {}
        dl = prepare_data_loader(DataLoader(data, batch_size=bs), even_batches=even, split_batches=split, **extra)
        try:
            if kind == "tensor":
                got = _loop(dl)
            elif kind == "dict":
                got = []
                for batch in dl:
                    out = gather_for_metrics(_dev({"v": batch, "pair": (batch * 2, batch.float()[:, None])}))
                    assert out["pair"][0].tolist() == [2 * v for v in out["v"].tolist()]
                    assert out["pair"][1].shape == (len(out["v"]), 1)
                    got += out["v"].tolist()
            else:
                got = _loop(dl, lambda b: [f"s{v}" for v in b.tolist()])
                got = [int(s[1:]) for s in got]
        except Exception as err:  # noqa: BLE001
            got = repr(err)
        if not isinstance(got, list) or sorted(got) != list(range(n)):
            failures.append({"n": n, "bs": bs, "even": even, "iterable": iterable, "split": split,
                             "dispatch": dispatch, "kind": kind, "got": got})
    # use_gather_object on tensors, strings inside dict batches
    dl = prepare_data_loader(DataLoader(Records(7), batch_size=2), even_batches=False)
    names = []
    for batch in dl:
        names += gather_for_metrics(batch["name"])
        objs = gather_for_metrics(batch["x"], use_gather_object=True)
        assert all(isinstance(o, torch.Tensor) for o in objs)
        break_len = len(objs)
        assert break_len >= 1
    if sorted(names) != sorted(f"s{i}" for i in range(7)):
        failures.append({"records": names})
    return {"count": count, "failures": failures, "world": world}


def check_gather_for_metrics_outside_loader():
    world, rank = _world()
    t = torch.tensor([rank, rank], device=PartialState().device)
    assert gather_for_metrics(t).tolist() == [q for q in range(world) for _ in range(2)]
    assert gather_for_metrics([f"r{rank}"]) == [f"r{q}" for q in range(world)]
    scalar = gather_for_metrics(torch.tensor(float(rank), device=PartialState().device))
    return {"scalar": scalar.tolist()}


def check_gather_for_metrics_collective_count():
    """Full batches cost one gather per call and nothing more; padding costs one small exchange."""
    import hasten.data.metrics as metrics

    calls = {"gather": 0, "exchange": 0}
    originals = metrics.gather, metrics._all_gather_object

    def counting_gather(data):
        calls["gather"] += 1
        return originals[0](data)

    def counting_exchange(obj, state):
        calls["exchange"] += 1
        return originals[1](obj, state)

    metrics.gather, metrics._all_gather_object = counting_gather, counting_exchange
    out = {}
    try:
        for n in (16, 15):
            calls.update(gather=0, exchange=0)
            dl = prepare_data_loader(DataLoader(list(range(n)), batch_size=2))
            got = _loop(dl)
            assert sorted(got) == list(range(n)), got
            out[n] = dict(calls, batches=len(dl))
    finally:
        metrics.gather, metrics._all_gather_object = originals
    return out


def check_rng_types_synchronised():
    """rng_types=["torch"]: every pass starts from process 0's torch RNG state."""
    _, rank = _world()
    torch.manual_seed(50 + rank)
    dl = prepare_data_loader(DataLoader(list(range(4)), batch_size=2), rng_types=["torch"])
    draws = []
    for _ in dl:
        draws.append(torch.rand(1).item())
    return draws


def check_uneven_two_calls_per_batch_raise():
    """Two calls per batch with uneven batches: a clear error on every rank, never a hang."""
    world, _ = _world()
    dl = prepare_data_loader(DataLoader(list(range(5)), batch_size=2), even_batches=False)
    try:
        for batch in dl:
            gather_for_metrics(_dev(batch))
            gather_for_metrics(_dev(batch * 10))
    except RuntimeError as err:
        return {"raised": "one gather_for_metrics call per batch" in str(err), "world": world}
    return {"raised": False, "world": world}
