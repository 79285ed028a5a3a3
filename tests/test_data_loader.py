"""Dataloader sharding, device placement and exact gather_for_metrics.

Sharding arithmetic is tested in this process (samplers take num_processes/process_index as
arguments); everything that talks between processes runs in real processes, one launch per world
size (tests/checks_data.py).
"""

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from distributed import run_checks
from hasten.data_loader import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    SkipBatchSampler,
    prepare_data_loader,
    skip_first_batches,
)

MODULE = "checks_data"


@pytest.fixture(scope="module")
def two():
    return run_checks(MODULE, world_size=2, timeout=240)


@pytest.fixture(scope="module")
def one():
    return run_checks(MODULE, world_size=1, timeout=240)


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


# -- batch-sampler sharding, in process ---------------------------------------------------------------
def _shards(n, bs, procs, split=False, even=True, drop=False):
    sampler = BatchSampler(SequentialSampler(range(n)), bs, drop)
    # pad_lone_step: as prepare_data_loader builds them (the default leaves tiny data's extra ranks empty)
    shards = [BatchSamplerShard(sampler, procs, r, split_batches=split, even_batches=even, pad_lone_step=True)
              for r in range(procs)]
    batches = [list(s) for s in shards]
    return shards, batches


def test_batch_sampler_shard_known_layouts():
    _, b = _shards(10, 3, 2)
    assert b == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    _, b = _shards(10, 3, 2, even=False)
    assert b == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    _, b = _shards(10, 4, 2, split=True)
    assert b == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    _, b = _shards(10, 4, 2, split=True, even=False)
    assert b == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    _, b = _shards(10, 3, 2, drop=True)
    assert b == [[[0, 1, 2]], [[3, 4, 5]]]
    _, b = _shards(2, 3, 3)  # fewer samples than one step: padding cycles through them
    assert b == [[[0, 1, 0]], [[1, 0, 1]], [[0, 1, 0]]]
    _, b = _shards(7, 2, 1)  # one process: untouched, no padding
    assert b == [[[0, 1], [2, 3], [4, 5], [6]]]


@pytest.mark.parametrize("procs", [2, 3])
def test_batch_sampler_shard_grid_properties(procs):
    """Over a grid: real samples = the dataset exactly once; even = same count and size; len() right."""
    for n, bs, split, even, drop in itertools.product(range(0, 14), range(1, 7), (False, True), (False, True),
                                                       (False, True)):
        if split and bs % procs:
            continue
        shards, batches = _shards(n, bs, procs, split, even, drop)
        cfg = (n, bs, split, even, drop)
        for shard, mine in zip(shards, batches):
            assert len(shard) == len(mine), cfg
        plan = shards[0].current_plan
        real = Counter()
        for r, mine in enumerate(batches):
            p = shards[r].current_plan
            assert p.finished and p.num_steps >= len(mine), cfg
            assert [p.records[t].sizes[r] for t in range(len(mine))] == [len(b) for b in mine], cfg
            for t, b in enumerate(mine):
                real.update(b[:p.records[t].real[r]])
        full_steps = n // (bs if split else bs * procs)
        expected = Counter(range(full_steps * (bs if split else bs * procs))) if drop else Counter(range(n))
        if drop and not split:  # drop_last keeps the complete groups of full batches only
            expected = Counter(range((n // bs // procs) * procs * bs))
        assert real == expected, (cfg, real, expected)
        assert all(r.real == shards[q].current_plan.records[t].real
                   for q in range(procs) for t, r in plan.records.items()), cfg
        if n and not drop:
            assert all(len(mine) >= 1 for mine in batches), cfg  # nobody is left without a batch
        if even and n:
            assert len({len(m) for m in batches}) == 1, cfg
            sizes = {len(b) for m in batches for b in m}
            assert len(sizes) <= 1, cfg


def test_batch_sampler_shard_custom_variable_batches():
    class Growing:
        def __iter__(self):
            return iter([[0], [1, 2], [3, 4, 5], [6, 7, 8, 9], [10]])

        def __len__(self):
            return 5

    b = [list(BatchSamplerShard(Growing(), 2, r)) for r in range(2)]
    assert b == [[[0], [3, 4, 5], [10]], [[1, 2], [6, 7, 8, 9], [0]]]
    b = [list(BatchSamplerShard(Growing(), 2, r, even_batches=False)) for r in range(2)]
    assert b == [[[0], [3, 4, 5], [10]], [[1, 2], [6, 7, 8, 9]]]


class Listed:
    """A batch sampler of given batches (not seekable: a resume walks it)."""

    def __init__(self, batches, batch_size=None):
        self.batches = batches
        if batch_size is not None:
            self.batch_size, self.drop_last = batch_size, False

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self):
        return len(self.batches)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("seekable", [True, False])
def test_batch_sampler_shard_resumed_anywhere_ends_like_the_uninterrupted_pass(seekable, split):
    # 2 processes, even_batches=False. Whole batches: 5 batches of 2, the last step has a batch for
    # process 0 only. Split batches: 3 batches of 4 cut in halves, the short last one [8, 9] is all
    # process 0's. Both also when the pass resumes right at that step (not the epoch's only one).
    def make(rank):
        size = 4 if split else 2
        if seekable:
            batches = BatchSampler(SequentialSampler(range(10)), size, False)
        else:
            # split batches need a batch size to cut; whole ones are walked without one
            batches = Listed([list(range(i, min(i + size, 10))) for i in range(0, 10, size)],
                             batch_size=size if split else None)
        return BatchSamplerShard(batches, 2, rank, split_batches=split, even_batches=False)

    full = [list(make(r)) for r in range(2)]
    assert full == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    for rank in range(2):
        for skip in range(4):
            shard = make(rank)
            shard.skip_batches = skip
            assert list(shard) == full[rank][skip:], (rank, skip)


def test_batch_sampler_shard_bad_arguments():
    sampler = BatchSampler(SequentialSampler(range(10)), 3, False)
    with pytest.raises(ValueError, match="batch_size=3 is not a round multiple of 2"):
        BatchSamplerShard(sampler, 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="process_index=2"):
        BatchSamplerShard(sampler, 2, 2)


def test_iterable_dataset_shard():
    shards = [list(IterableDatasetShard(Stream(11), 2, num_processes=2, process_index=r)) for r in range(2)]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 0]]
    shards = [list(IterableDatasetShard(Stream(11), 4, num_processes=2, process_index=r, split_batches=True))
              for r in range(2)]
    assert shards == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 0]]
    shards = [list(IterableDatasetShard(Stream(11), 2, drop_last=True, num_processes=2, process_index=r))
              for r in range(2)]
    assert shards == [[0, 1, 4, 5], [2, 3, 6, 7]]
    for n, bs in itertools.product(range(1, 14), range(1, 5)):  # no sample twice among the real ones
        got = [list(IterableDatasetShard(Stream(n), bs, num_processes=3, process_index=r)) for r in range(3)]
        assert len({len(g) for g in got}) == 1 and len(got[0]) % bs == 0
        assert sorted(set(x for g in got for x in g)) == list(range(n))
    with pytest.raises(ValueError, match="batch_size=3 is not a round multiple of 2"):
        IterableDatasetShard(Stream(4), 3, num_processes=2, split_batches=True)


def test_seedable_random_sampler():
    a = SeedableRandomSampler(range(20), data_seed=11)
    b = SeedableRandomSampler(range(20), data_seed=11)
    first, second = list(a), list(a)  # each completed pass moves to the next epoch
    assert first == list(b) and second == list(b)
    assert first != second and sorted(first) == list(range(20))
    a.set_epoch(0)
    assert list(a) == first
    # as Accelerate's: the default seed is torch's initial seed, also when a generator is given
    assert SeedableRandomSampler(range(5), generator=torch.Generator().manual_seed(9)).initial_seed == torch.initial_seed()
    c = SeedableRandomSampler(range(5), replacement=True, num_samples=12, data_seed=1)
    assert len(list(c)) == 12


# -- prepared loaders, in process ----------------------------------------------------------------------
def test_prepare_keeps_loader_settings():
    def collate(items):
        return torch.tensor(items) * 10

    def init(worker_id):
        pass

    gen = torch.Generator().manual_seed(3)
    dl = DataLoader(list(range(9)), batch_size=2, shuffle=True, collate_fn=collate, num_workers=1,
                    worker_init_fn=init, generator=gen, timeout=5, persistent_workers=True, prefetch_factor=3,
                    pin_memory=False)
    p = prepare_data_loader(dl, num_processes=2, process_index=1)
    assert isinstance(p, DataLoader) and isinstance(p, DataLoaderShard)
    assert p.dataset is dl.dataset and p.collate_fn is collate and p.num_workers == 1
    assert p.worker_init_fn is init and p.generator is gen and p.timeout == 5
    assert p.persistent_workers and p.prefetch_factor == 3
    # the user's generator keeps drawing the order, as in a plain DataLoader
    assert type(p.sampler) is torch.utils.data.RandomSampler and p.sampler.generator is gen
    assert p.batch_size == 2 and p.total_batch_size == 4 and len(p) == 3 and p.total_dataset_length == 9
    assert dl.batch_sampler.sampler is dl.sampler  # the user's loader is left as it was
    values = [v for b in p for v in b.tolist()]
    assert len(values) == 6 and all(v % 10 == 0 for v in values)


def test_prepare_bad_arguments():
    with pytest.raises(ValueError, match="put_on_device=True"):
        prepare_data_loader(DataLoader(list(range(4))), dispatch_batches=True)
    with pytest.raises(ValueError, match="batch_size=None"):
        prepare_data_loader(DataLoader(list(range(4)), batch_size=None))
    with pytest.raises(ValueError, match="not a round multiple of 2"):
        prepare_data_loader(DataLoader(list(range(9)), batch_size=3), split_batches=True, num_processes=2)
    with pytest.raises(TypeError, match="DataLoader"):
        prepare_data_loader([1, 2, 3])


def test_epochs_skip_and_resume_in_process():
    make = lambda: prepare_data_loader(DataLoader(list(range(12)), batch_size=2, shuffle=True), data_seed=5,
                                       use_seedable_sampler=True, num_processes=2, process_index=0)
    dl = make()
    e0, e1 = [b.tolist() for b in dl], [b.tolist() for b in dl]
    assert e0 != e1 and dl.iteration == 2
    dl.set_epoch(0)
    assert [b.tolist() for b in dl] == e0
    it = iter(dl)  # epoch 1 again, interrupted: the next pass is still a new epoch
    next(it)
    state = dl.state_dict()
    del it
    assert state == {"epoch": 1, "batches_yielded": 1}
    fresh = make()
    fresh.load_state_dict(state)
    assert [b.tolist() for b in fresh] == e1[1:]
    skipped = skip_first_batches(make(), 2)
    assert isinstance(skipped, DataLoaderShard) and len(skipped) == 1
    assert [b.tolist() for b in skipped] == e0[2:]
    # plain DataLoaders
    plain = skip_first_batches(DataLoader(list(range(7)), batch_size=2), 2)
    assert [b.tolist() for b in plain] == [[4, 5], [6]]
    assert isinstance(plain.batch_sampler, SkipBatchSampler)
    it_plain = skip_first_batches(DataLoader(Stream(7), batch_size=2), 3)
    assert [b.tolist() for b in it_plain] == [[6]]


def test_set_even_batches_switches_the_next_pass():
    dl = prepare_data_loader(DataLoader(list(range(5)), batch_size=2), num_processes=2, process_index=1)
    assert [b.tolist() for b in dl] == [[2, 3], [1, 2]]  # rank 0 holds [4, 0]
    dl.set_even_batches(False)  # what Accelerator.join_uneven_inputs does
    assert [b.tolist() for b in dl] == [[2, 3]] and len(dl) == 1


def test_import_hasten_stays_light():
    import subprocess
    import sys

    code = "import sys, hasten; hasten.data_loader if False else None; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# -- real processes ----------------------------------------------------------------------------------
def test_sharding_layouts_two_processes(two):
    r0, r1 = two.assert_passed("check_sharding_layouts")
    assert r0["plain"]["batches"] == [[0, 1, 2], [6, 7, 8]] and r1["plain"]["batches"] == [[3, 4, 5], [9, 0, 1]]
    assert r1["uneven"] == {"batches": [[3, 4, 5], [9]], "len": 2}
    assert r0["split"]["batches"] == [[0, 1], [4, 5], [8, 9]] and r1["split"]["batches"] == [[2, 3], [6, 7], [0, 1]]
    assert r1["split_uneven"] == {"batches": [[2, 3], [6, 7]], "len": 2}
    assert r0["drop_last"]["batches"] == [[0, 1, 2]] and r1["drop_last"]["batches"] == [[3, 4, 5]]
    assert "batch of 3 samples" in r0["split_error"] and "not a round multiple of 2" in r0["split_error"]


def test_sharding_layouts_one_process(one):
    (r,) = one.assert_passed("check_sharding_layouts")
    assert r["plain"]["batches"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert r["split"]["batches"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_custom_samplers_survive(two):
    r0, r1 = two.assert_passed("check_custom_samplers_survive")
    assert r0["backwards"] == [[7, 6], [3, 2]] and r1["backwards"] == [[5, 4], [1, 0]]
    assert r0["growing"] == [[0], [3, 4, 5]] and r1["growing"] == [[1, 2], [6, 7, 8, 9]]


def test_shuffle_same_on_every_rank_new_each_epoch(two, one):
    r0, r1 = two.assert_passed("check_shuffle_agrees_and_changes")
    assert r0["epochs"] == r1["epochs"]  # every rank saw the same split of the same permutation
    orders = []
    for epoch in r0["epochs"]:
        together = epoch[0] + epoch[1]
        assert sorted(together) == list(range(12))  # same permutation on both ranks: no overlap
        orders.append(together)
    assert len({tuple(o) for o in orders}) == 3  # new order each epoch
    assert r0["epoch1_again"] == r0["seedable_epoch1"] and r1["epoch1_again"] == r1["seedable_epoch1"]
    assert r0["seedable_epoch1"] != r1["seedable_epoch1"]
    assert r0["seeded"][0] == r0["seeded"][1] and sorted(r0["seeded"][0] + r1["seeded"][0]) == list(range(12))
    assert r0["own_generator"] is True
    (solo,) = one.assert_passed("check_shuffle_agrees_and_changes")
    assert len({tuple(e[0]) for e in solo["epochs"]}) == 3


def test_iterable_dataset_shard_no_duplicates(two):
    r0, r1 = two.assert_passed("check_iterable_shard_no_duplicates")
    for key in r0:
        n = int(key.split("-")[0])
        values = [v for b in r0[key] + r1[key] for v in b]
        assert set(values) == set(range(n)), key
        assert len(r0[key]) == len(r1[key])
    assert r0["11-2-False"] == [[0, 1], [4, 5], [8, 9]] and r1["11-2-False"] == [[2, 3], [6, 7], [10, 0]]
    assert r0["8-2-False"] + r1["8-2-False"] == [[0, 1], [4, 5], [2, 3], [6, 7]]


def test_dispatch_matches_sharding(two, one):
    assert len(two.assert_passed("check_dispatch_matches_sharding")[0]) == 11
    one.assert_passed("check_dispatch_matches_sharding")


def test_dispatch_only_main_process_reads(two):
    r0, r1 = two.assert_passed("check_dispatch_only_main_reads")
    assert r0 == [[[0, 1], ["t0", "t1"]], [[4, 5], ["t4", "t5"]]]
    assert r1 == [[[2, 3], ["t2", "t3"]], [[0, 1], ["t0", "t1"]]]


def test_device_placement_and_end_of_dataloader(two, one):
    for r in two.assert_passed("check_device_and_end_of_dataloader"):
        assert r == {"flags": [False, False, True], "devices": ["meta"], "len": 3}
    (r,) = one.assert_passed("check_device_and_end_of_dataloader")
    assert r["flags"] == [False] * 4 + [True]


def test_skip_first_batches(two, one):
    r0, r1 = two.assert_passed("check_skip_first_batches")
    assert r0["full"][0] == [0, 1] and r1["full"][0] == [2, 3]
    one.assert_passed("check_skip_first_batches")


def test_resume_from_state_dict(two):
    assert two.assert_passed("check_resume_state_dict") == [{"epoch": 1, "batches_yielded": 2}] * 2


def test_rng_types_synchronised(two):
    r0, r1 = two.assert_passed("check_rng_types_synchronised")
    assert r0 == r1


@pytest.mark.parametrize("world", [1, 2])
def test_gather_for_metrics_grid(world, one, two):
    report = {1: one, 2: two}[world]
    for value in report.assert_passed("check_gather_for_metrics_grid"):
        assert value["count"] == 13 * 4 * 2 * 2
        assert value["failures"] == [], "failing configurations:\n" + "\n".join(map(str, value["failures"]))


@pytest.mark.parametrize("world", [1, 2])
def test_gather_for_metrics_variants(world, one, two):
    report = {1: one, 2: two}[world]
    for value in report.assert_passed("check_gather_for_metrics_variants"):
        assert value["count"] > 200
        assert value["failures"] == [], "failing configurations:\n" + "\n".join(map(str, value["failures"]))


def test_gather_for_metrics_outside_loader(two, one):
    assert [r["scalar"] for r in two.assert_passed("check_gather_for_metrics_outside_loader")] == [[0.0, 1.0]] * 2
    assert one.assert_passed("check_gather_for_metrics_outside_loader") == [{"scalar": 0.0}]


def test_gather_for_metrics_costs(two):
    for r in two.assert_passed("check_gather_for_metrics_collective_count"):
        assert r["16"] == {"gather": 4, "exchange": 0, "batches": 4}  # full batches: one gather per call
        assert r["15"] == {"gather": 4, "exchange": 1, "batches": 4}  # padding: one small exchange, at the end


def test_uneven_batches_two_calls_per_batch_raise(two):
    assert two.assert_passed("check_uneven_two_calls_per_batch_raise") == [{"raised": True, "world": 2}] * 2
