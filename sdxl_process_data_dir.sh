#!/usr/bin/env bash
# Cache a dataset with one worker per GPU of this machine (or NUM_WORKERS CPU workers), optionally as one of
# several machines on a shared filesystem. Any flag of sdxl_process_data_dir.py can be appended, e.g.:
#   bash sdxl_process_data_dir.sh --data_dir /data/images --cache_dir /data/cache
#   NUM_WORKERS    workers on this machine (default: number of GPUs, 1 without a GPU)
#   NUM_MACHINES   machines sharing the dataset (default 1); each runs this same command ...
#   MACHINE_RANK   ... with its own rank 0 .. NUM_MACHINES-1 (default 0)
#   VENV_DIR       virtual env to use (default: venv next to this script; created if missing)
# Worker k of machine m runs --num_shards NUM_WORKERS*NUM_MACHINES --shard_index m*NUM_WORKERS+k (these two
# flags are set here). The script waits for every worker and fails if any of them failed; re-running the
# same command resumes where it stopped.
set -euo pipefail
SCRIPT_DIR=$(cd "$(dirname "$0")" && pwd)
VENV_DIR=${VENV_DIR:-$SCRIPT_DIR/venv}
[ -x "$VENV_DIR/bin/python" ] || (cd "$SCRIPT_DIR" && bash create_venv.sh)

if [ -z "${NUM_WORKERS:-}" ]; then
    NUM_WORKERS=$(bash "$SCRIPT_DIR/tools/gpu_count.sh" "$VENV_DIR")
    [ "$NUM_WORKERS" -gt 0 ] || NUM_WORKERS=1
fi
NUM_MACHINES=${NUM_MACHINES:-1}
MACHINE_RANK=${MACHINE_RANK:-0}
NUM_SHARDS=$(( NUM_WORKERS * NUM_MACHINES ))
# CPU workers share the cores instead of each starting one thread per core.
THREADS_PER_WORKER=$(( $(nproc) / NUM_WORKERS > 0 ? $(nproc) / NUM_WORKERS : 1 ))

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
for (( worker = 0; worker < NUM_WORKERS; worker++ )); do
    LOCAL_RANK=$worker OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS_PER_WORKER} PYTHONPATH="$SCRIPT_DIR${PYTHONPATH:+:$PYTHONPATH}" \
        "$VENV_DIR/bin/python" "$SCRIPT_DIR/sdxl_process_data_dir.py" "$@" \
        --num_shards "$NUM_SHARDS" --shard_index $(( MACHINE_RANK * NUM_WORKERS + worker )) &
    pids+=($!)
done

failed=0
for (( worker = 0; worker < NUM_WORKERS; worker++ )); do
    if ! wait "${pids[$worker]}"; then
        echo "worker $worker (shard $(( MACHINE_RANK * NUM_WORKERS + worker )) of $NUM_SHARDS) failed" >&2
        failed=1
    fi
done
exit $failed
