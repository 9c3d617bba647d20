#!/usr/bin/env bash
# Train with one process per GPU (2 CPU processes on a machine without a GPU). Any flag of
# sdxl_FSDP_train.py can be appended, e.g.: bash train.sh --cached_dataset_dirs cache/ --num_train_epochs 5
#   NUM_PROCESSES      processes on this machine (default: its number of GPUs, or 2 without a GPU)
#   NUM_MACHINES       machines in the job (default 1); run this script on each of them with
#   MACHINE_RANK       this machine's index, 0 .. NUM_MACHINES-1 (default 0)
#   MAIN_PROCESS_IP    address of machine 0 (default 127.0.0.1), MAIN_PROCESS_PORT its rendezvous port (or
#                      MASTER_PORT; default: a free port on one machine, so runs side by side do not collide;
#                      29500 with NUM_MACHINES > 1, where every machine must name the same)
#   VENV_DIR           virtual env to use (default: venv next to this script; created if missing)
#   SHUTDOWN_TIMEOUT_S seconds torchrun gives the workers to save state after SIGTERM/SIGINT (default 600)
# One process on one machine runs without torchrun (python directly), so there a signal reaches the trainer
# itself, which saves state before it ends, however long that takes.
set -euo pipefail
cd "$(dirname "$0")"
VENV_DIR=${VENV_DIR:-venv}
[ -x "$VENV_DIR/bin/python" ] || bash create_venv.sh
processes=${NUM_PROCESSES:-}
if [ -z "$processes" ]; then
    processes=$(bash tools/gpu_count.sh "$VENV_DIR")
    [ "$processes" -gt 0 ] || processes=2
fi

source tools/allocator_settings.sh  # the heap an update frees is kept for the next one

if [ "$processes" -eq 1 ] && [ "${NUM_MACHINES:-1}" -eq 1 ]; then
    # The trainer forms its own one-process group and keeps every core (a CPU optimizer step, --cpu_offload,
    # needs them). torchrun would start it in a new session, where beside other jobs it got less of the CPU
    # (docs/training.md, "Launching (train.sh)").
    exec "$VENV_DIR/bin/python" sdxl_FSDP_train.py "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # what torchrun sets for several processes, without its banner
# The rendezvous port: as given; else on one machine "free" (the launcher takes a port free then), else 29500.
port=${MAIN_PROCESS_PORT:-${MASTER_PORT:-}}
if [ -z "$port" ]; then
    if [ "${NUM_MACHINES:-1}" -eq 1 ]; then port=free; else port=29500; fi
fi
# torchrun, less the launcher output that would follow a failing rank's message (sdxl_trainer/launcher.py).
exec "$VENV_DIR/bin/python" -m sdxl_trainer.distributed.launcher \
    --nproc_per_node "$processes" \
    --nnodes "${NUM_MACHINES:-1}" \
    --node_rank "${MACHINE_RANK:-0}" \
    --master_addr "${MAIN_PROCESS_IP:-127.0.0.1}" \
    --master_port "$port" \
    --shutdown_timeout "${SHUTDOWN_TIMEOUT_S:-600}" \
    sdxl_FSDP_train.py "$@"
