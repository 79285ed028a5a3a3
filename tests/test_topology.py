"""Process layout read from torchrun, MPI and SLURM variables (pure functions, no processes)."""

import pytest

from hasten.topology import detect_topology, first_host
from hasten.utils.environment import get_env, parse_flag, parse_int


def test_single_process_by_default():
    t = detect_topology({})
    assert (t.rank, t.world_size, t.source, t.distributed) == (0, 1, "single", False)


def test_torchrun_variables():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    t = detect_topology(env)
    assert (t.rank, t.local_rank, t.world_size, t.local_world_size, t.node_rank, t.num_nodes) == (5, 1, 8, 4, 1, 2)
    assert (t.master_addr, t.master_port, t.source) == ("10.0.0.1", 1234, "torchrun")


def test_open_mpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}
    t = detect_topology(env)
    assert (t.rank, t.local_rank, t.world_size, t.node_rank, t.num_nodes, t.master_addr, t.source) == \
        (3, 1, 4, 1, 2, "node0", "mpi")
    assert t.master_port == 29500


def test_mpich_variables_single_node_default_address():
    t = detect_topology({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (t.rank, t.world_size, t.master_addr, t.source) == (1, 2, "127.0.0.1", "mpi")


def test_mpi_multi_node_needs_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_topology(env)


def test_slurm_step_variables():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242",
           "SLURM_STEP_NODELIST": "gpu[07-08]"}
    t = detect_topology(env)
    assert (t.rank, t.local_rank, t.world_size, t.local_world_size, t.node_rank, t.num_nodes) == (6, 2, 8, 4, 1, 2)
    assert (t.master_addr, t.master_port, t.source) == ("gpu07", 20000 + 4242 % 20000, "slurm")


def test_slurm_batch_shell_is_not_a_rank():
    # The batch script itself has SLURM_PROCID=0 but is not a step: it must not wait for 7 peers.
    t = detect_topology({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"})
    assert t.world_size == 1


def test_torchrun_wins_over_slurm():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}
    assert detect_topology(env).source == "torchrun"


@pytest.mark.parametrize("nodelist, host", [("gpu[03-05,9],cpu1", "gpu03"), ("nodeA", "nodeA"), ("n[1,4]", "n1")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_bad_rank_is_reported():
    with pytest.raises(ValueError, match="rank 3 is outside the world of 2"):
        detect_topology({"RANK": "3", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_topology({"RANK": "x", "WORLD_SIZE": "2"})


def test_env_prefixes():
    env = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DEBUG_MODE": "1"}
    assert get_env("MIXED_PRECISION", environ=env) == "bf16"
    assert parse_flag("DEBUG", environ=env) is True
    env["HASTEN_MIXED_PRECISION"] = "fp16"
    assert get_env("MIXED_PRECISION", environ=env) == "fp16"
    with pytest.raises(ValueError, match="HASTEN_GRADIENT_ACCUMULATION_STEPS"):
        parse_int("GRADIENT_ACCUMULATION_STEPS", 1, environ={"HASTEN_GRADIENT_ACCUMULATION_STEPS": "four"})
    with pytest.raises(ValueError, match="boolean"):
        parse_flag("USE_CPU", environ={"HASTEN_USE_CPU": "maybe"})


def test_each_local_rank_gets_its_own_gpu_or_a_clear_error():
    """torchrun --nproc_per_node 2 on one GPU: the second process stops with the fixes instead of taking cuda:0
    too (both processes on one GPU hang in NCCL's first collective)."""
    from hasten.device_choice import own_gpu

    assert [own_gpu(rank, 2, None) for rank in (0, 1)] == [0, 1]
    with pytest.raises(RuntimeError) as err:
        own_gpu(1, 1, "3")
    message = str(err.value)
    assert "local rank 1 has no GPU of its own: this node shows 1 CUDA device(s) (CUDA_VISIBLE_DEVICES='3')" in message
    assert "hasten launch --num_processes 1" in message and "hasten launch --cpu" in message
    assert "HASTEN_USE_CPU=1" in message and "Accelerator(cpu=True)" in message
