"""Tensor and N-D parallelism on real gloo processes (checks in checks_tp.py), layouts and their errors."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from distributed import free_port, one_process_checkpoint, run_checks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def single_checkpoint(tmp_path_factory):
    """A checkpoint written by one process without tensor parallelism."""
    import checks_tp

    folder = str(tmp_path_factory.mktemp("single") / "ckpt")
    return one_process_checkpoint(folder, checks_tp._mlp(), checks_tp.FEATURES)


@pytest.fixture(scope="module")
def two(tmp_path_factory, single_checkpoint):
    tmp = str(tmp_path_factory.mktemp("tp"))
    report = run_checks("checks_tp", world_size=2, env={"TP_TMP": tmp, "TP_SINGLE_CKPT": single_checkpoint[0]})
    report.tmp = tmp
    return report


def test_tp_on_two_processes_equals_one_process(two):
    for r in two.assert_passed("check_tp_mlp_equals_one_process"):
        assert r["worst"] < 1e-5 and r["placements"] == "(Shard(dim=0),)"


def test_transformers_model_under_its_own_tp_plan(two):
    for r in two.assert_passed("check_tp_llama_plan_equals_one_process"):
        assert r["worst"] < 1e-5 and r["split"] == 15  # 7 linears x 2 layers + lm_head


def test_qwen3_per_head_norms_get_gradients_summed_over_tp(two):
    """transformers' replicated_with_grad_allreduce (Qwen3's q_norm/k_norm): under TP alone with gradient
    accumulation 2 (SGD, 2 updates), the weights equal one process's within 1e-5."""
    for r in two.assert_passed("check_tp_qwen3_plan_with_accumulation_equals_one_process"):
        print("qwen3 tp2, largest differences from one process:", r)
        assert r["worst"] < 1e-5 and r["q_k_norms"] < 1e-5, r


def test_gather_for_metrics_exact_under_tp(two):
    assert two.assert_passed("check_tp_gather_for_metrics_exact") == [list(range(13))] * 2


def test_tp_checkpoint_roundtrip_and_from_no_tp(two, single_checkpoint):
    r = two.assert_passed("check_tp_checkpoint_roundtrip")[0]
    assert r["layout"]["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert r["layout"]["strategy"] == "TensorParallelStrategy"
    expected = single_checkpoint[1]
    assert all(torch.equal(torch.tensor(r["from_single"][k]), torch.tensor(expected[k])) for k in expected)


def test_tp_checkpoint_loads_without_tp(two, fresh_state):
    """A TP checkpoint of 2 processes into a plain model on 1 process (DCP reshards), bitwise."""
    import checks_tp

    from hasten import Accelerator

    saved = two.assert_passed("check_tp_checkpoint_roundtrip")[0]["saved"]
    acc = Accelerator()
    model = checks_tp._mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(checks_tp._data(), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.load_state(os.path.join(two.tmp, "tp_ckpt"))
    assert len(opt.state) == 6
    got = model.state_dict()
    assert all(torch.equal(got[k].cpu(), torch.tensor(saved[k])) for k in saved)  # the model may be on a GPU


def test_tp_device_mesh_ranks_and_fp16_overflow_agreed(two):
    for rank, facts in enumerate(two.assert_passed("check_tp_device_mesh_and_fp16_overflow_on_one_process")):
        assert facts["names"] == ["tp"] and facts["shape"] == [2]
        assert facts["flat"] == {"dp": None, "dp_shard_cp": None, "dp_cp": None}
        assert facts["ranks"] == {"dp_replicate": 0, "dp_shard": 0, "tp": rank, "cp": 0}
        assert facts["local"] == {"tp": rank}


def test_tp_with_fsdp_over_a_dp_shard_of_one(two):
    for rank, r in enumerate(two.assert_passed("check_tp_with_fsdp_over_dp_shard_of_one")):
        assert r["worst"] < 1e-5
        assert r["mesh"]["names"] == ["dp_shard", "tp"] and r["mesh"]["shape"] == [1, 2]
        assert r["mesh"]["ranks"] == {"dp_replicate": 0, "dp_shard": 0, "tp": rank, "cp": 0}


def test_tp_size_not_dividing_heads_is_named(two):
    assert "tp_size=2 does not divide num_attention_heads=3" in two.assert_passed(
        "check_tp_bad_heads_named_before_communication")[0]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_checks("checks_tp", world_size=4, only=["check_dp_shard_times_tp_equals_one_process",
                                                       "check_hsdp_equals_one_process"])


def test_dp_shard_times_tp_on_four_processes(four):
    for rank, r in enumerate(four.assert_passed("check_dp_shard_times_tp_equals_one_process")):
        assert r["worst"] < 1e-5 and r["gathered"] == 13
        shard, tp = divmod(rank, 2)  # row-major over (dp_shard, tp), as Accelerate's mesh
        assert r["mesh"]["names"] == ["dp_shard", "tp"] and r["mesh"]["shape"] == [2, 2]
        assert r["mesh"]["flat"] == {"dp": [2, shard], "dp_shard_cp": [2, shard], "dp_cp": [2, shard]}
        assert r["mesh"]["ranks"] == {"dp_replicate": 0, "dp_shard": shard, "tp": tp, "cp": 0}
        assert r["mesh"]["local"] == {"dp_shard": shard, "tp": tp}


def test_hsdp_on_four_processes(four):
    for r in four.assert_passed("check_hsdp_equals_one_process"):
        assert r["worst"] < 1e-5


# -- layouts refused before the process group exists ---------------------------------------------------
_BAD = textwrap.dedent("""
    import sys
    from hasten import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
    import torch.distributed as dist
    cases = [dict(tp_size=4), dict(dp_shard_size=2, tp_size=2), dict(cp_size=2), dict(dp_shard_size=2)]
    for case in cases:
        fsdp = case.pop("fsdp", False)
        try:
            Accelerator(parallelism_config=ParallelismConfig(**case),
                        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None)
        except ValueError as e:
            print("ERROR", e)
        else:
            print("NO ERROR", case)
        assert not dist.is_initialized()
""")


def test_bad_layouts_fail_before_any_process_group_work():
    """Rank 0 of a 2-process job whose rank 1 never comes: any process-group work would hang."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), HASTEN_USE_CPU="1")
    out = subprocess.run([sys.executable, "-c", _BAD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("ERROR") for line in lines), out.stdout
    assert "tp_size=4 = 4 processes, but this job runs 2" in lines[0]
    assert "dp_shard_size=2 x cp_size=1 x tp_size=2 = 4 processes" in lines[1]
    # cp runs on the CPU now (torch's ring with the CPU kernel), under FSDP2 only
    assert "cp_size=2 shards the model over dp_shard x cp with FSDP2" in lines[2]
    assert "dp_shard_size=2 shards the model with FSDP2" in lines[3]


@pytest.mark.parametrize("sizes, world", [
    (dict(), 1),  # FSDP on one process: a dp_shard of one
    (dict(tp_size=2, dp_shard_size=1), 2),  # FSDP over a dp_shard of one, TP inside (Accelerate accepts it)
    (dict(dp_replicate_size=2, dp_shard_size=1), 2),  # replication under FSDP2 (HSDP with a shard dim of 1)
])
def test_fsdp_layouts_with_a_dp_shard_of_one_are_accepted(sizes, world):
    from hasten.utils import ParallelismConfig

    ParallelismConfig(**sizes).check(world, sharded=True, device_type="cpu")


def test_parallelism_config_reads_accelerate_environment(monkeypatch):
    from hasten.utils import ParallelismConfig

    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    p = ParallelismConfig()
    assert (p.dp_replicate_size, p.dp_shard_size, p.tp_size, p.cp_size, p.total_size) == (1, 2, 4, 1, 8)


@pytest.mark.parametrize("kwargs, named", [
    (dict(tp_size=0), "tp_size=0"),
    (dict(dp_shard_size="two"), "dp_shard_size='two'"),
    (dict(sp_backend="ulysses"), "sp_backend='ulysses'"),
    (dict(cp_size=2, sp_size=2), "cp_size=2 with sp_size=2"),
    (dict(sp_size=2, tp_size=2), "sp_size=2 with tp_size=2"),
    (dict(cp_backend="ring"), "cp_backend='ring'"),
    (dict(dp_replicate_size=2, tp_size=2), "dp_replicate_size=2 with tp_size=2"),
])
def test_parallelism_config_bad_values_are_named(kwargs, named):
    from hasten.utils import ParallelismConfig

    with pytest.raises(ValueError) as info:
        ParallelismConfig(**kwargs)
    assert named in str(info.value)


def test_unknown_tp_plan_key_and_style_are_named():
    from torch import nn

    from hasten.strategies.tp_plan import resolve_plan

    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="tp_plan key 'layers.\\*.q' matches no module of Sequential"):
        resolve_plan(model, {"layers.*.q": "colwise"})
    with pytest.raises(ValueError, match="tp_plan\\['0'\\] = 'diagonal': unknown style"):
        resolve_plan(model, {"0": "diagonal"})
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        resolve_plan(model, None)


# -- context parallelism: the one-process parts (2 processes: test_sequence_split.py) ------------------
def test_maybe_context_parallel_is_a_no_op_without_cp(fresh_state, caplog):
    from hasten import Accelerator
    from hasten.utils import ParallelismConfig

    for config in (None, ParallelismConfig()):
        acc = Accelerator(parallelism_config=config)
        ids, labels = torch.arange(12).reshape(2, 6), torch.arange(12).reshape(2, 6) + 1
        before = ids.clone(), labels.clone()
        with caplog.at_level("WARNING"):
            with acc.maybe_context_parallel(buffers=[ids, labels], buffer_seq_dims=[1, 1], no_restore_buffers={ids}):
                inside = ids.shape, labels.shape
        assert inside == ((2, 6), (2, 6)) and torch.equal(ids, before[0]) and torch.equal(labels, before[1])
        from hasten.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    assert "context and sequence parallelism are off (cp_size=1, sp_size=1)" in caplog.text


def test_cp_comm_strategy_is_checked():
    from hasten.strategies.context_parallel import comm_strategy

    class Handler:
        cp_comm_strategy = "alltoall"

    assert comm_strategy(None) == "allgather" and comm_strategy(Handler()) == "alltoall"
    Handler.cp_comm_strategy = "ring"
    with pytest.raises(ValueError, match="Invalid cp_comm_strategy: ring \\(ParallelismConfig\\); use one of \\['allgather', 'alltoall'\\]"):
        comm_strategy(Handler())


def test_cp_model_preparation_drops_masks_and_refuses_what_ring_attention_cannot_run():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from hasten.strategies.context_parallel import prepare_model

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    with pytest.raises(ValueError, match="sliding_attention"):
        prepare_model(MistralForCausalLM(MistralConfig(sliding_window=8, **small)), None)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        prepare_model(LlamaForCausalLM(LlamaConfig(**small, attn_implementation="eager")), None)
    model = LlamaForCausalLM(LlamaConfig(**small, attn_implementation="sdpa"))
    prepare_model(model, None)
    seen = {}
    attn = model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    model(input_ids=torch.arange(8).reshape(1, 8), attention_mask=torch.ones(1, 8, dtype=torch.long))
    assert seen["attention_mask"] is None and seen["is_causal"] is True
