"""What every script's process needs first: safe file writes and locks, quiet libraries, the garbage collector."""
