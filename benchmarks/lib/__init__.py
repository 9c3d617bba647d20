"""What the benchmark commands share: the models and batches they time, the trainer's update and the plain
loop it is compared with, the FLOP counts, the timing, the profiler's summary and the result files.

The commands (benchmarks/*.py) put the repository root on sys.path and import from here
(`from benchmarks.lib.steps import build_trainer`); no command imports another. The modules, each with one job:
  unets           the UNets (full-size SDXL, the tests' tiny one) with seeded random weights, synthetic batches,
                  the noise scheduler
  steps           the trainer's update built the trainer's way, and the plain PyTorch loop compared with it
  synthetic_cache a cache of random latents and embeddings, written through the trainer's own cache writer
  comparison      trainer against plain loop: each path built, timed and freed, and the table of figures
  flops           FLOP per training image (counted on the meta device) and the device's matmul peak
  timing          seconds per step over a measured window (or in alternating rounds), optimizer.step's own time
  profiling       torch.profiler over a few steps: the busiest operators, device busy time against wall time
  run_logs        a trainer run's ms per update from its TensorBoard log, the GPU's busy share while it ran
  images          random captioned images, as a data folder holds them
  processes       launching 1 or 2 CPU processes of a worker; a function run in a fresh process
  results         the facts every result file carries (date, machine, versions, git commit, command), and writing it
"""
