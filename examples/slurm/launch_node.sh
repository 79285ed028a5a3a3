#!/bin/bash
# The launcher of one node, run by multinode.sbatch's srun (one task per node).
# Reads:  SLURM_NNODES, SLURM_NODEID (srun sets them), MAIN_PROCESS_IP, MAIN_PROCESS_PORT,
#         GPUS_PER_NODE (multinode.sbatch exports them), and optionally
#         RDZV_BACKEND (c10d, the default here, or static) and EXTRA_LAUNCH_ARGS (more
#         `hasten launch` flags, e.g. "--mixed_precision bf16", or "--dry_run" to print the plan).
# Arguments: the training script and its own arguments.
set -euo pipefail

NUM_NODES=${SLURM_NNODES:?run inside a SLURM job step (srun), or set SLURM_NNODES}
NODE_RANK=${SLURM_NODEID:-${SLURM_PROCID:?set SLURM_NODEID or SLURM_PROCID}}

# --num_processes counts the processes of all nodes, as in Accelerate.
# shellcheck disable=SC2086  # EXTRA_LAUNCH_ARGS is a list of flags
exec hasten launch \
    --num_machines "$NUM_NODES" \
    --machine_rank "$NODE_RANK" \
    --num_processes $((NUM_NODES * ${GPUS_PER_NODE:-1})) \
    --main_process_ip "${MAIN_PROCESS_IP:?set MAIN_PROCESS_IP to node 0 host name}" \
    --main_process_port "${MAIN_PROCESS_PORT:-29500}" \
    --rdzv_backend "${RDZV_BACKEND:-c10d}" \
    ${EXTRA_LAUNCH_ARGS:-} \
    "$@"
