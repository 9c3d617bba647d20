"""SDXL's networks: the published configs, the tiny test pipeline, single-file checkpoints, and the frozen encoders."""
