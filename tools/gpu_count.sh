#!/usr/bin/env bash
# Prints the number of GPUs this machine's processes can use (train.sh and sdxl_process_data_dir.sh ask it).
#   bash tools/gpu_count.sh VENV_DIR
# torch's count honours CUDA_VISIBLE_DEVICES (nvidia-smi would list every GPU of the machine), but importing
# torch takes seconds: where no GPU device exists (no /dev/nvidia0..., /dev/dxg of WSL2 or /dev/kfd of ROCm)
# the answer is 0 without it.
set -euo pipefail
if compgen -G "/dev/nvidia[0-9]*" > /dev/null || [ -e /dev/dxg ] || [ -e /dev/kfd ]; then
    "$1/bin/python" -c "import torch; print(torch.cuda.device_count())"
else
    echo 0
fi
