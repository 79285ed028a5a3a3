"""Expert parallelism on real gloo processes (checks in checks_expert_parallel.py), its layout rule and refusals.

One launch of 2 processes (ep=2 over dp_shard=2) and one of 4 (ep=2 x dp_shard=4: the experts also
FSDP-sharded over their own sub-mesh) each run every check; the tests judge what the ranks reported.
"""

import os
import subprocess
import sys

import pytest
import torch

from distributed import run_checks

pytest.importorskip("transformers")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ep2"))
    report = run_checks("checks_expert_parallel", world_size=2, env={"EP_TMP": tmp})
    report.tmp = tmp
    return report


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ep4"))
    report = run_checks("checks_expert_parallel", world_size=4, env={"EP_TMP": tmp},
                        only=["check_ep_equals_one_process_and_checkpoints", "check_ep_with_hsdp_equals_one_process",
                              "check_ep_borrowing_dp_shard_and_tp_equals_one_process"])
    report.tmp = tmp
    return report


def _judge_equivalence(report, local_shape, check="check_ep_equals_one_process_and_checkpoints", model="Qwen3Moe",
                       dims=("efsdp", "ep")):
    for r in report.assert_passed(check):
        print(check, "largest differences from one process:", r["worst"])
        assert all(v <= TOLERANCE for v in r["worst"].values()), r["worst"]
        assert r["class"] == f"FSDPExpertParallel{model}Experts" and r["local_experts"] == 2
        assert r["expert_mesh"] == list(dims) and r["local_shape"] == local_shape, r
        assert r["aux"] == pytest.approx(r["ref_aux"], abs=TOLERANCE)  # the whole batch's router statistics
    return r


def test_ep2_on_two_processes_equals_one_process_with_aux_loss(two):
    """Loss (with 0.1 x the router's auxiliary loss), aux loss, clipped norms, gradients and weights after
    3 AdamW steps with clipping: each within 1e-5 of one process on the same global batch."""
    r = _judge_equivalence(two, [2, 32, 32])  # 2 of 4 experts, not sharded further (efsdp = 1)
    assert r["mesh"] == "ParallelMesh(pp=1, dp_replicate=1, dp_shard=2, cp=1, sp=1, tp=1, ep=2)"
    assert r["recorded"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2}  # in the manifest


def test_ep2_with_fsdp2_on_four_processes_equals_one_process(four):
    """ep=2 x dp_shard=4: each expert FSDP-sharded over the 2 processes holding it; clipping counts
    each expert shard once (the norms agree with one process)."""
    r = _judge_equivalence(four, [1, 32, 32])  # 2 experts per ep rank, FSDP2 keeps 1 each
    assert r["mesh"] == "ParallelMesh(pp=1, dp_replicate=1, dp_shard=4, cp=1, sp=1, tp=1, ep=2)"


def test_ep2_with_hsdp_on_four_processes_equals_one_process(four):
    """dp_replicate=2 x dp_shard=2, ep=2: the experts replicated over dp_replicate, split over ep."""
    _judge_equivalence(four, [2, 32, 32], "check_ep_with_hsdp_equals_one_process",
                       dims=("dp_replicate", "efsdp", "ep"))


def test_ep_with_layers_wrapped_and_activation_checkpointing_equals_one_process(two):
    r = _judge_equivalence(two, [2, 32, 32], "check_ep_with_decoder_layers_wrapped_and_checkpointed")
    assert r["checkpointed"] == 2  # both decoder layers


def test_mixtral_under_its_own_ep_plan_equals_one_process(two):
    _judge_equivalence(two, [2, 32, 32], "check_mixtral_ep_equals_one_process", "Mixtral")


def test_plain_pytorch_moe_split_by_its_plan_equals_one_process(two):
    r = two.assert_passed("check_plain_pytorch_moe_under_a_user_plan")[0]
    assert r["worst"] <= TOLERANCE and r["norms"] <= TOLERANCE and r["local"] == [2, 8, 16]


def _judge_borrowing(results, local_shape, model):
    for r in results:
        print("largest differences from one process:", r["worst"])
        assert all(v <= TOLERANCE for v in r["worst"].values()), r["worst"]
        assert r["aux"] == pytest.approx(r["ref_aux"], abs=TOLERANCE)  # the whole batch's router statistics
        assert r["class"] == f"FSDPExpertParallel{model}Experts" and r["local_shape"] == local_shape, r


def test_ep_borrowing_the_tp_processes_equals_one_process(two):
    """tp_size=2, ep_size=2 on 2 processes (Mixtral): attention split by its tp plan, the experts split
    whole over the same two processes (the plan's experts keys left out), each sending half of the
    shared tokens; loss, aux loss, clipped norms, gradients and weights after 3 AdamW steps."""
    results = two.assert_passed("check_ep_borrowing_tp_equals_one_process")
    _judge_borrowing(results, [2, 32, 32], "Mixtral")
    assert all("Shard(dim=0)" in r["attention"] for r in results)  # q_proj is split over tp


@pytest.mark.parametrize("axis", ["cp", "sp"])
def test_ep_borrowing_the_sequence_processes_equals_one_process(two, axis):
    """cp_size=2 (ring attention) or sp_size=2 (Ulysses) with ep_size=2: each process its half of every
    sequence, the experts split over the same two processes; the loss over all tokens and the router's
    loss of the whole batch equal one process's."""
    _judge_borrowing(two.assert_passed(f"check_ep_borrowing_{axis}_equals_one_process"), [2, 32, 32], "Qwen3Moe")


def test_ep_borrowing_dp_shard_and_tp_processes_equals_one_process(four):
    """dp_shard_size=2 x tp_size=2: ep=4 (one expert per process, two batches each shared by a tp pair)
    and ep=2 (the experts of each tp pair FSDP-sharded over the two processes holding them)."""
    for r in four.assert_passed("check_ep_borrowing_dp_shard_and_tp_equals_one_process"):
        _judge_borrowing([r["ep4"]], [1, 32, 32], "Mixtral")
        _judge_borrowing([r["ep2"]], [1, 32, 32], "Mixtral")


def test_tensor_plan_experts_styles_point_to_ep_and_are_left_out_under_ep():
    """Without ep, transformers' experts styles in a tp plan are refused pointing to ep_size; under ep the
    plan's experts keys are left out (the experts are split whole over ep). Qwen3's per-head norms
    (replicated_with_grad_allreduce) are accepted: their gradients are summed over tp."""
    from checks_expert_parallel import _qwen3_moe

    from hasten.strategies.expert_parallel import planned_experts, without_experts
    from hasten.strategies.tp_plan import GradientSum, model_plan, resolve_plan

    model = _qwen3_moe()
    with pytest.raises(ValueError, match=r"gate_up_proj'\] = 'packed_colwise'.*ParallelismConfig\(ep_size"):
        resolve_plan(model, None)
    kept = without_experts(model_plan(model), model, planned_experts(model, model, None))
    assert not any("experts" in k for k in kept) and "model.layers.*.self_attn.q_proj" in kept
    resolved = resolve_plan(model, kept, own=True)
    assert "model.layers.0.self_attn.q_proj" in resolved
    assert isinstance(resolved["model.layers.0.self_attn.q_norm"], GradientSum)


def test_qwen3_moe_under_its_tp_plan_with_ep_equals_one_process(two):
    """tp_size=2, ep_size=2 with Qwen3-MoE's own tp plan: q_norm/k_norm whole, their gradients summed over tp."""
    results = two.assert_passed("check_qwen3_moe_tp_with_ep_equals_one_process")
    _judge_borrowing(results, [2, 32, 32], "Qwen3Moe")
    assert all(r["q_norm_local"] == [8] for r in results)


def test_ep_refusals_in_the_process_name_the_fix(two):
    r = two.assert_passed("check_ep_refusals_name_the_fix")[0]
    assert "ep_size=2 does not divide num_experts=3 of model.layers.0.mlp.experts" in r["experts"]
    assert "use ep_size=1" in r["experts"] and "\n" not in r["experts"]
    assert "hasten launch --use_fsdp" in r["no_fsdp"] and "\n" not in r["no_fsdp"]


@pytest.mark.parametrize("which", ["two", "four"])
def test_ep_checkpoint_loads_on_one_process_and_save_model_is_one_file(which, request, fresh_state):
    """save_state at ep=2 (DCP shards) -> load_state on one plain process: the same weights, bitwise,
    and the optimizer state; save_model wrote one ordinary safetensors file of the whole experts."""
    import checks_expert_parallel as checks
    from safetensors.torch import load_file

    from hasten import Accelerator

    report = request.getfixturevalue(which)
    report.assert_passed("check_ep_equals_one_process_and_checkpoints")
    saved = torch.load(os.path.join(report.tmp, "ep_weights.pt"))
    acc = Accelerator()
    model = checks._qwen3_moe()
    opt = torch.optim.AdamW(model.parameters(), lr=checks.LR)
    model, opt = acc.prepare(model, opt)
    acc.load_state(os.path.join(report.tmp, "ep_ckpt"))
    got = model.state_dict()
    assert set(got) == set(saved)
    assert all(torch.equal(got[k].cpu(), saved[k]) for k in saved)
    assert len(opt.state) == len(list(model.parameters()))
    files = sorted(os.listdir(os.path.join(report.tmp, "ep_model")))
    assert files == ["model.safetensors"], files
    written = load_file(os.path.join(report.tmp, "ep_model", "model.safetensors"))
    assert written["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert all(torch.equal(written[k], saved[k]) for k in written) and len(written) >= len(saved) - 1


def test_layout_rule_ep_borrows_the_processes_of_one_model_copy():
    """ep is no factor of the product rule; it divides dp_shard x cp x sp x tp (every process when nothing
    else is asked)."""
    from hasten.layout import AXES, BORROWED, Layout

    assert "ep" not in AXES and BORROWED == ("ep",)
    assert Layout.asked({"ep": 2}, 4).dp_shard == 4  # FSDP2's own layout, experts over 2 of its processes
    Layout.from_sizes({"dp_shard": 4, "ep": 4}, 4).check()
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide dp_shard_size=4.*use ep_size=2"):
        Layout.asked({"ep": 3}, 4).check()
    Layout.from_sizes({"dp_shard": 2, "tp": 2, "ep": 4}, 4).check()  # borrows tp processes too
    Layout.from_sizes({"cp": 2, "ep": 2}, 2).check()
    with pytest.raises(ValueError, match=r"ep_size=3 does not divide dp_shard_size=2 x tp_size=2 = 4.*use ep_size=2"):
        Layout.from_sizes({"dp_shard": 2, "tp": 2, "ep": 3}, 4).check()
    with pytest.raises(ValueError, match=r"ep_size=4 does not divide dp_shard_size=1 x cp_size=2 = 2.*use ep_size=2"):
        Layout.from_sizes({"cp": 2, "ep": 4}, 2).check()


def test_parallelism_config_reads_ep_size_from_the_environment(monkeypatch):
    from hasten.utils.parallelism_config import ParallelismConfig

    monkeypatch.setenv("PARALLELISM_CONFIG_EP_SIZE", "2")
    config = ParallelismConfig()
    assert config.ep_size == 2 and "ep" not in config.sizes() and config.all_sizes()["ep"] == 2
    with pytest.raises(ValueError, match="turn it on with fsdp_plugin"):
        config.check(2, sharded=False, device_type="cpu")
    with pytest.raises(ValueError, match="ep_size=2 does not divide dp_shard_size=3"):
        config.check(3, sharded=True, device_type="cpu")


def test_launcher_refuses_a_bad_ep_size_in_one_line_without_torch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    probe = ("import sys; from hasten.commands.cli import main\n"
             "try:\n    code = main(['launch', '--cpu', '--num_processes', '4', '--use_fsdp', "
             f"'--parallelism_config_ep_size', '3', {str(script)!r}])\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('exit', code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert "exit 2 False" in done.stdout, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "ep_size 3 (command line --parallelism_config_ep_size) does not divide" in lines[0]
    assert "use --parallelism_config_ep_size 2" in lines[0] and "ran" not in done.stdout
