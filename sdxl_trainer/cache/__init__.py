"""The cache: the format both scripts share (layout, buckets, manifest), where it is stored, and how it is written, read and verified."""
