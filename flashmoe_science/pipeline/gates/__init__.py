"""Stage 3, gates: is every kernel correct over the sequence-length x head-dim matrix?

forward.py (prefill and decode), backward.py, varlen.py and paged.py name the cases and compare each
against a float32 reference with PyTorch's own low-precision error as the bound; ragged.py holds
what varlen and paged share; kernels.py says which kernels a case's gate runs (what the restricted
build of a planted-bug test holds). plugin.py is the pytest plugin that records every gate;
testing.py is `python -m flashmoe_science test`, the bisect-safe command around pytest; devices.py
spreads its workers over the GPUs, and timelimit.py stops a run that hangs, naming what it is stuck
in.
Reads: the built unit, tests/. Writes: reports/gates.json.
"""
