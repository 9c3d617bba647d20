"""What a run leaves for its users: the exported model, LoRA extraction, TensorBoard / W&B logging."""
