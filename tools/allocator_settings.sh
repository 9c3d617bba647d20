# Sourced by train.sh and run_tests.sh: glibc's allocator thresholds, unless they are set.
# glibc would hand the heap an update frees back to the OS and fault it in again in the next forward: keep
# it (fewer page faults and less CPU per update: benchmarks/bench_allocator.py measures both side by side;
# docs/training.md, "Launching (train.sh)").
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-33554432} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-1073741824}
