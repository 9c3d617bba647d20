"""Answers about a configuration before running it: the memory estimate."""
