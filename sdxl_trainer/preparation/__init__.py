"""Turning a data folder, a metadata table or tar shards into prepared items: scanning, reading images, upscaling, cropping."""
