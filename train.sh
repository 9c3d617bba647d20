#!/usr/bin/env bash
# Train with one process per GPU (2 CPU processes on a machine without a GPU). Any flag of
# sdxl_FSDP_train.py can be appended, e.g.: bash train.sh --cached_dataset_dirs cache/ --num_train_epochs 5
#   NUM_PROCESSES      processes on this machine (default: its number of GPUs, or 2 without a GPU)
#   NUM_MACHINES       machines in the job (default 1); run this script on each of them with
#   MACHINE_RANK       this machine's index, 0 .. NUM_MACHINES-1 (default 0)
#   MAIN_PROCESS_IP    address of machine 0 (default 127.0.0.1), MAIN_PROCESS_PORT (default 29500)
#   VENV_DIR           virtual env to use (default: venv next to this script; created if missing)
#   SHUTDOWN_TIMEOUT_S seconds torchrun gives the workers to save state after SIGTERM/SIGINT (default 600)
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
[ -x "$VENV_DIR/bin/python" ] || bash create_venv.sh
gpus=$("$VENV_DIR/bin/python" -c "import torch; print(torch.cuda.device_count())")
[ "$gpus" -gt 0 ] || gpus=2
processes=${NUM_PROCESSES:-$gpus}
# What torchrun sets for several processes (without its banner); one process keeps every core, which a CPU
# optimizer step (--cpu_offload) needs.
[ "$processes" -le 1 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun, less the launcher output that would follow a failing rank's message (sdxl_trainer/launcher.py).
exec "$VENV_DIR/bin/python" -m sdxl_trainer.launcher \
    --nproc_per_node "$processes" \
    --nnodes "${NUM_MACHINES:-1}" \
    --node_rank "${MACHINE_RANK:-0}" \
    --master_addr "${MAIN_PROCESS_IP:-127.0.0.1}" \
    --master_port "${MAIN_PROCESS_PORT:-29500}" \
    --shutdown_timeout "${SHUTDOWN_TIMEOUT_S:-600}" \
    sdxl_FSDP_train.py "$@"
