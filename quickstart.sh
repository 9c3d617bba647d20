#!/usr/bin/env bash
# End to end on the bundled sample_dataset/, offline, in minutes on a CPU: build a tiny random SDXL
# pipeline, cache the 30 sample images with it, train 2 epochs on 2 processes (or all GPUs), export.
# Image validation is off: its metric networks would be downloads, and a random model's images score nothing.
#   OUTPUT_DIR   where everything goes (default output/quickstart)
set -euo pipefail
cd "$(dirname "$0")"
OUTPUT_DIR=${OUTPUT_DIR:-output/quickstart}
VENV_DIR=${VENV_DIR:-venv}
bash create_venv.sh
export HF_HUB_OFFLINE=1

"$VENV_DIR/bin/python" -m sdxl_trainer.models.tiny "$OUTPUT_DIR/tiny_sdxl"
bash sdxl_process_data_dir.sh \
    --data_dir sample_dataset \
    --cache_dir "$OUTPUT_DIR/cache" \
    --pretrained_model_name_or_path "$OUTPUT_DIR/tiny_sdxl" \
    --min_resolution 256 --max_resolution 320
bash train.sh \
    --cached_dataset_dirs "$OUTPUT_DIR/cache" \
    --num_train_epochs 2 --learning_rate 1e-4 --set_seed 123 \
    --num_inference_steps 10 --num_sample_images 4 \
    --no-validation_image \
    --output_dir "$OUTPUT_DIR" --project_name run \
    --overwrite_run  # a demo: running it again starts the run over (a real run refuses that without the flag)

echo
echo "Quickstart finished."
echo "  cache:            $OUTPUT_DIR/cache"
echo "  TensorBoard logs: $OUTPUT_DIR/run/tensorboard   (tensorboard --logdir $OUTPUT_DIR/run/tensorboard)"
echo "  exported model:   $OUTPUT_DIR/run/pipeline      (StableDiffusionXLPipeline.from_pretrained)"
echo "  sample grid:      $OUTPUT_DIR/run/samples/sample_grid.png"
