"""Stage 6, ci: the trusted steps of GPU CI, run from main's code, never a pull request's.

gpuci.py decides which commit may run on a GPU runner, sets the required status and posts the
report; runartifacts.py takes a run's approval and legs for the report, by exact name, checked
before they are read; historybranch.py reads and writes main's bench history on its own branch;
runner_requirements.py says which driver and nvcc a runner needs for a torch.
Reads: the GitHub event and the legs' report artifacts. Writes: the PR comment, the commit status,
the bench-history branch.
"""
