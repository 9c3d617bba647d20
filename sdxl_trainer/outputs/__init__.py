"""What a run leaves for its users: the exported model (diffusers / single file) and LoRA extraction."""
