"""Stage 1, env: is this machine fit to build and run the kernels?

`python -m flashmoe_science env` (checks.py) probes Python, torch and its CUDA, nvcc, the GPU and its
driver, ninja, the host compiler, free disk and NumPy, and judges each apart from the probing.
Reads: the interpreter and the machine. Writes: reports/env.json. A failed check exits 255, so
`git bisect run` stops instead of blaming a commit.
"""
