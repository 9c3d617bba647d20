"""Optimizers that step each rank's FSDP2 shards: 8-bit AdamW, AdamW, Lion, Adafactor, CAME, and bf16 stochastic rounding."""
