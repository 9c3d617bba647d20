"""Watching a run: the training scalars (TensorBoard / W&B), train.log, throughput and peak memory."""
