#!/usr/bin/env bash
# Multi-machine training under SLURM: one train.sh (torchrun) per machine, each starting one process per GPU.
#   sbatch slurm_train.sh --config configs/multinode_4x8x80gb.toml
# Any trainer flag can follow. The cache and output folder must be on a filesystem every machine sees.
# SIGTERM comes 10 minutes before the time limit, so the run saves state and a resubmitted job goes on
# from it with --load_saved_state latest (set in the multi-node config).
#SBATCH --job-name=sdxl_finetune
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --signal=TERM@600
#SBATCH --output=slurm-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"
MAIN_PROCESS_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PROCESS_IP MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-29500} NUM_MACHINES=$SLURM_NNODES
# One task per machine; each learns its machine rank from SLURM.
srun --kill-on-bad-exit=1 bash -c 'MACHINE_RANK=$SLURM_NODEID exec bash train.sh "$@"' bash "$@"
