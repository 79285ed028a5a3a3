"""The loop-shape matrix (issue #34 §2): every shape of a training loop around ``accelerator.backward``
equals one plain PyTorch process, or is refused before anything changes; under DDP, FSDP2 and
DeepSpeed ZeRO-1/2/3 on 2 real processes (checks in checks_loop_shapes.py), and one process in-process."""

import pytest

from distributed import run_checks

import checks_loop_shapes as shapes_module

BACKENDS = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def two():
    return run_checks("checks_loop_shapes", world_size=2)


def _judge(backend: str, per_rank: list[dict]) -> None:
    expected = [shapes_module.name_of(s) for s in shapes_module.shapes(backend)]
    for rank, results in enumerate(per_rank):
        assert sorted(results) == sorted(expected), (rank, sorted(set(expected) ^ set(results)))
        failed = {name: r["failed"] for name, r in results.items() if "failed" in r}
        assert not failed, (backend, rank, failed)
        for name, r in results.items():
            # DeepSpeed cannot checkpoint a step it holds for the loop's own optimizer.step(): refused on
            # every process, before anything changed (the loop then went on and still equals torch).
            refused = backend.startswith("zero") and name.endswith("-save")
            assert bool(r["refused"]) == refused, (backend, name, r["refused"])
            if refused:
                assert "save_state between accelerator.backward and optimizer.step()" in r["refused"][0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_loop_shapes_equal_plain_pytorch_on_two_processes(two, backend):
    if backend.startswith("zero"):
        pytest.importorskip("deepspeed")
    _judge(backend, two.assert_passed(f"check_matrix_{backend}"))


def test_loop_shapes_equal_plain_pytorch_in_one_process(fresh_state, tmp_path):
    """One process without DeepSpeed (no process group): the same matrix, in this process."""
    results = {}
    for shape in shapes_module.shapes("ddp"):
        name = shapes_module.name_of(shape)
        results[name] = shapes_module.run_shape(shape, "ddp", str(tmp_path / name))
    _judge("ddp", [results])


@pytest.mark.parametrize("name", ["check_scheduler_step_without_optimizer_step",
                                  "check_clip_after_an_eval_forward_still_clips",
                                  "check_clip_after_the_step_ran_is_an_error",
                                  "check_auto_gradient_clipping_is_accelerates"])
def test_deepspeed_held_step(two, name):
    pytest.importorskip("deepspeed")
    two.assert_passed(name)
