"""What outlives a process: resumable checkpoints (DCP) and when they are written, and the run folder's guards."""
