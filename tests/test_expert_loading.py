"""A plain MoE safetensors file loaded into expert shards (checks in checks_expert_loading.py).

One launch of 2 processes (ep=2 over dp_shard=2) and one of 4 (ep=2 x dp_shard=4, each expert also
FSDP-sharded over the 2 processes holding it); the tests judge what the ranks reported.
"""

import pytest

from distributed import run_checks

pytest.importorskip("transformers")

TOLERANCE = 1e-5
CHECKS = ("check_plain_file_loads_into_expert_shards_and_trains_as_one_process",
          "check_model_built_on_meta_loads_into_expert_shards_and_trains_as_one_process",
          "check_cpu_ram_efficient_loading_fills_expert_shards_from_process_0")


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep2_x_dp_shard4"])
def report(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp(f"eploading{request.param}"))
    return run_checks("checks_expert_loading", world_size=request.param, env={"EP_TMP": tmp})


# Rows of the 4 experts (dimension 0 of gate_up_proj [4, 32, 32]) each process took from the file.
ROWS = {2: [[0, 2], [2, 4]], 4: [[0, 1], [2, 3], [1, 2], [3, 4]]}  # 4: ranks are (efsdp, ep) row-major


def _judge(report, check):
    results = report.assert_passed(check)
    for r in results:
        print(check, "largest differences:", r["worst"])
        assert r["worst"]["loaded"] == 0.0  # every weight is the file's, bitwise
        assert all(v <= TOLERANCE for v in r["worst"].values()), r["worst"]
    rows = [r["block"][0] for r in results]
    assert rows == ROWS[report.world_size], rows  # each process asked the file for its own experts' rows only
    assert all(r["block"][1:] == [[0, 32], [0, 32]] for r in results)


def test_plain_moe_file_loads_into_expert_shards_each_process_its_experts(report):
    """load_checkpoint_in_model(prepared ep model, folder of one plain safetensors file): each process copies
    its experts' rows; the weights equal the file, and 3 AdamW steps equal one process on the whole batch."""
    _judge(report, CHECKS[0])


def test_model_built_on_meta_under_ep_is_filled_from_the_file(report):
    """init_empty_weights() on every process, prepared under ep: no process ever builds every expert."""
    _judge(report, CHECKS[1])


def test_cpu_ram_efficient_loading_under_ep_gives_process_0s_experts(report):
    _judge(report, CHECKS[2])


READ_CHECK = "check_each_process_reads_only_its_experts_from_the_file"


def test_each_process_reads_only_its_experts_bytes_and_loads_them_bitwise(report):
    """The experts are ~95% of the file: each process reads (rchar, during load_checkpoint_in_model) under
    0.6x of a plain save_file file and of a save_model file (4 KiB checksummed blocks), and its shards
    are the file's bitwise."""
    results = report.assert_passed(READ_CHECK)
    for rank, r in enumerate(results):
        for name in ("plain", "hasten"):
            f = r[name]
            print(f"rank {rank} {name}: read {f['read']} of {f['size']} bytes ({f['read'] / f['size']:.3f})")
            assert f["bitwise"], (rank, name)
            assert f["read"] < 0.6 * f["size"], (rank, name, f)
    assert [r["rows"][0] for r in results] == ROWS[report.world_size]


def test_a_flipped_bit_in_process_1s_experts_raises_on_every_process_naming_the_file(report):
    """One bit flipped mid-row of an expert only process 1 reads (save_model file): process 1 finds its
    block's checksum differs; every process raises, naming the file; none waits."""
    results = report.assert_passed(READ_CHECK)
    for rank, r in enumerate(results):
        error = r["corrupt"]
        assert error is not None, rank
        assert "corrupt" in error["message"] and "model.safetensors" in error["message"], (rank, error)
    assert results[1]["corrupt"]["type"] == "CheckpointCorruptError", results[1]["corrupt"]
    assert "block" in results[1]["corrupt"]["message"] and "checksum" in results[1]["corrupt"]["message"]
    assert results[0]["corrupt"]["type"] == "RuntimeError"  # process 0 read nothing wrong: told by process 1
