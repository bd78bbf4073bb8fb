"""GPU CI's own steps: what runs, on which commit, and what main keeps.

gpuci.py decides which commit may run on a GPU runner, sets the required status and posts the
report (run from main's code, never a pull request's); runartifacts.py takes a run's approval and
legs for the report, by exact name, checked before they are read; selection.py decides whether a
pull request's leg runs the full matrix or reuses the verdict main recorded for the same build;
historybranch.py reads and writes main's bench history and verdicts on their own branch;
runner_requirements.py says which driver and nvcc a runner needs for a torch.
Reads: the GitHub event, the changed paths, the legs' report artifacts. Writes: the PR comment,
the commit status, reports/selection.json, the bench-history branch.
"""
