#!/usr/bin/env bash
# The GPU battery: what only a GPU can show, in one command of at most 10 minutes on one H100/H200.
#   bash benchmarks/gpu_check.sh [OUTPUT_DIR]     (default benchmarks/results/DATE-GPU)
# Writes OUTPUT_DIR/gpu_check.log (everything printed) and OUTPUT_DIR/gpu_check.json (every part's figures):
#   0. end_to_end: train.sh as users run it, on a cache of random 1024 px images made with a random full-size
#      pipeline, for batch 4 with checkpointing (eager and --compile_unet) and configs/1x24gb_bf16.toml: ms per
#      update from each run's own log, GPU busy share, a state save's pause, and the step benchmark beside it
#      (train_end_to_end.py); a variant that crashes is named and the part exits 1
#   1. throughput of the trainer's step on the full-size UNet at 1024 px: batch 1, 4, 8 with gradient
#      checkpointing on and off (img/s, MFU, peak memory, the first update's seconds: compilation)
#   2. each shipped config's per-GPU load run for real, capped at its card's size, next to --estimate_memory's
#      figure (gpu_memory_check.py; the estimates come from benchmarks/results/memory_estimates.json if
#      present), with the time of a whole update: this covers --weights_dtype bf16 and --cpu_offload
#   3. batch 4: the trainer's step next to a plain PyTorch loop, and torchao's own AdamW8bit instead of ours
#   4. batch 4 with --compile_unet (regional torch.compile): is the step still waiting for the CPU?
#   Parts 3 and 4 also profile two updates of each path (OUTPUT_DIR/profile/: the busiest kernels, and in
#   profiles.json the GPU's busy time against the wall time and the optimizer step's share).
#   5. bf16, fp16 and bf16 weights against fp32 training over a few updates (gpu_numerics.py)
#   6. host_waits: tests/training/test_host_waits.py on the GPU (the tiny model, 8-bit and fp32 AdamW), where CUDA's sync
#      debug mode refuses every wait for the device on the updates that do not log (about a minute)
# Each part has its own time limit: one that fails or runs out of time is logged and the next one runs.
#   PYTHON           the interpreter (default: venv/bin/python, else python3)
#   GPU_CHECK_PARTS  the parts to run, by name (default: end_to_end alone, at most 9.5 minutes: the speed users
#                    see comes first; the others: sweep memory plain_reference torchao_adamw8bit compile_unet
#                    numerics host_waits, together at most 23 minutes, so one 10-minute command takes a choice)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
    echo "No GPU answered nvidia-smi: this battery measures GPUs. Without one, use --estimate_memory and the CPU benchmarks." >&2
    exit 2
fi
short=$(echo "$gpu" | tr 'A-Z' 'a-z' | grep -oE '[a-z][0-9]{2,4}' | head -1)
OUTPUT_DIR=${1:-benchmarks/results/$(date -u +%Y-%m-%d)-${short:-gpu}}
mkdir -p "$OUTPUT_DIR"
parts=$(mktemp -d)
log="$OUTPUT_DIR/gpu_check.log"
export PYTHONUNBUFFERED=1
# One compile cache for every part: a kernel compiled by one (our 8-bit AdamW step) is reused by the next.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$parts/inductor}

GPU_CHECK_PARTS=${GPU_CHECK_PARTS:-end_to_end}

part() {  # part SECONDS NAME PYTHON-ARGS...: the part's JSON goes to $parts/NAME.json
    local seconds=$1 name=$2 started=$SECONDS
    shift 2
    [[ " $GPU_CHECK_PARTS " == *" $name "* ]] || { echo "=== $name: not in GPU_CHECK_PARTS, skipped" | tee -a "$log"; return; }
    echo "=== $name (at most $seconds s): $PYTHON $*" | tee -a "$log"
    timeout --kill-after=15 "$seconds" "$PYTHON" "$@" 2>&1 | grep -v -E "Warning|warnings.warn|^ *$" | tee -a "$log"
    local code=${PIPESTATUS[0]}
    echo "=== $name: exit $code after $((SECONDS - started)) s" | tee -a "$log"
    [ "$code" -eq 0 ] || failed_parts+=("$name")
    # Every finished part's JSON in one file, keyed by part name (a part that failed is absent), rewritten
    # after each part so that what ran is kept if the battery is cut short.
    "$PYTHON" -c "
import json, sys
from pathlib import Path
parts = {path.stem: json.loads(path.read_text()) for path in sorted(Path(sys.argv[1]).glob('*.json'))}
Path(sys.argv[2]).write_text(json.dumps(parts, indent=1) + '\\n')
" "$parts" "$OUTPUT_DIR/gpu_check.json"
}

failed_parts=()
{
    date -u "+%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PYTHON" -c "import torch, diffusers, torchao; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'diffusers', diffusers.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1
} | tee "$log"

part 570 end_to_end benchmarks/train_end_to_end.py --json "$parts/end_to_end.json"
throughput="benchmarks/train_throughput.py --warmup_steps 2 --measured_steps 4"
part 120 sweep $throughput --sweep --reference none --json "$parts/sweep.json"
estimates=()
[ -f benchmarks/results/memory_estimates.json ] && estimates=(--estimates benchmarks/results/memory_estimates.json)
part 230 memory benchmarks/gpu_memory_check.py --measure "${estimates[@]}" --output "$parts/memory.json"
part 180 plain_reference $throughput --batch_size 4 --reference plain --profile "$OUTPUT_DIR/profile" --json "$parts/plain_reference.json"
part 300 torchao_adamw8bit $throughput --batch_size 4 --reference none --optimizer torchao_adamw8bit --json "$parts/torchao_adamw8bit.json"
part 200 compile_unet $throughput --batch_size 4 --reference none --compile --profile "$OUTPUT_DIR/profile" --json "$parts/compile_unet.json"
part 75 numerics benchmarks/gpu_numerics.py --output "$parts/numerics.json"
part 240 host_waits -m pytest tests/training/test_host_waits.py -q -p no:cacheprovider
echo "Written: $log and $OUTPUT_DIR/gpu_check.json"
rm -rf "$parts"
if [ ${#failed_parts[@]} -gt 0 ]; then
    echo "FAILED parts: ${failed_parts[*]} (their lines above say why)" | tee -a "$log"
    exit 1
fi
