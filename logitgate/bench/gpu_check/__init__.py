"""The GPU check: one command for a lent GPU machine (`make gpu-check`, `logitgate bench --gpu`).

Made for the machines as they are: Python 3.12 with CUDA torch and Triton preinstalled, numba and
pytest present, no network. Packages they lack (xgrammar, hypothesis and what those import) come as
wheels from a folder next to the checkout (`make gpu-wheels` fills .gpu-wheels/) and are installed
with `pip --no-index` when missing. One run, at most --budget-s seconds (default 600):

1. environment: device, versions, the packages installed from the wheel folder;
2. sync check: one decode step (tree advance + fill + bitmask apply, the Sampler with its noise
   prefetched, rejection sampling) under torch.cuda.set_sync_debug_mode("error"), part by part, and
   whether the exponential-trick noise drawn on the side stream really overlaps main-stream work
   (CUDA events, no synchronize() inside the step);
3. benchmarks with CUDA events, medians of interleaved runs (L2 flushed between runs), in this
   process: bitmask apply vs xgrammar's kernel and torch masked_fill, as us, GB/s and the fraction of
   the device-to-device copy bandwidth measured in the same run; top-k/top-p + random sampling vs
   vLLM's algorithm in torch and the sort-based reference; rejection sampling (B=64, k=4) vs vLLM's
   algorithm in torch and one read of the logits (the floor); tree fill, candidates, and the sparse
   path's kernels (gather candidates, keep only allowed, fill) vs their torch reference;
4. the test suite with LOGITGATE_DEVICE=cuda and native Triton (no interpreter), in what is left of
   the budget.

Results: one JSON (gpu_check.json, rewritten after every step, so a killed run still leaves what it
measured) and one markdown table (gpu_check.md) in the folder it prints. `--device cpu` is the dry
run: the same code on CPU tensors with small shapes, timed with perf_counter, no sync check (the
CPU has none to detect) and no tests unless --pytest-args names some.

    python -m logitgate.bench.gpu_check [--device cuda|cpu] [--out DIR] [--quick] [--budget-s 600]
                                [--wheels DIR] [--skip-tests] [--skip-bench] [--pytest-args "..."]

One module per job: wheels.py (install what is missing), probe.py (the machine), timing.py (events,
interleaved runs, variants), sync.py (the sync and overlap checks), bitmask.py, sampling.py,
rejection.py and tree.py (the bench-and-check families), suite.py (pytest on the device), report.py
(JSON and markdown), main.py (the run), config.py (shapes and goals).
"""
