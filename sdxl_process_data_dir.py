"""Cache a folder of image + caption pairs for SDXL training: VAE latents, both text embeddings, buckets.

For every image under --data_dir with a caption file of the same name (photo.jpg + photo.txt), every row
of a --metadata_table (JSONL or Parquet: path, caption or tags, score, under other names with
--table_columns; see sdxl_trainer/preparation/tables.py), or every sample of the .tar files under --data_dir with
--tar_shards (WebDataset layout, read without unpacking; see sdxl_trainer/preparation/tar_sources.py):
  1. read it upright (EXIF rotation), RGB, with transparency composited on white;
  2. skip it if it is smaller than the smallest bucket of --min_resolution;
  3. pick its aspect-ratio bucket (the largest resolution category up to --max_resolution that fits); with
     --upscale_to_resolution R, an image whose category is below R is first enlarged by an ESRGAN-family
     network (optionally with GFPGAN face restoration) and bucketed in category R, while its original size
     stays the pre-upscale size (SDXL micro-conditioning, so the model does not learn upscaling artefacts);
  4. resize to cover the bucket and centre-crop; encode the crop with the VAE and the caption with both
     text encoders;
  5. write shards of tensors (safetensors) + manifest parts (Parquet) into --cache_dir (see sdxl_trainer/cache/format.py).

Nothing is written into --data_dir. Re-running the same command skips items already cached with the same
image bytes and caption, re-encodes new or changed ones and those of shards found damaged (checksums), and
refuses a cache made with other settings. Skipped items are listed, one line each with the reason, in
<cache_dir>/logs/. --verify checks a cache without changing it; --dry_run prints the bucket histogram
without loading any model. Several workers (one per GPU or machine) split the data with --num_shards and
--shard_index (by a hash of each item's path; tar shards whole, by tar); sdxl_process_data_dir.sh starts them.
"""

from __future__ import annotations

import sys

from sdxl_trainer.config import parse_config
from sdxl_trainer.jobs.cache_config import CacheConfig
from sdxl_trainer.jobs.cache_job import run_caching


def main(argv: list[str] | None = None) -> int:
    config = parse_config(CacheConfig, argv, description=__doc__)
    return run_caching(config)


if __name__ == "__main__":
    sys.exit(main())
