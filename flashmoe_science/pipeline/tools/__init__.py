"""GPU tools beside the stages: what a kernel engineer runs on one case or one build.

sanitize.py runs compute-sanitizer's four tools over a workload that reaches every kernel path
(sanitize_coverage.py says what each tool checks of the Hopper features); profile.py runs Nsight
Compute on one bench case and says what bounds it; phases.py and decode_phases.py trace a kernel's
time phase by phase; cudatools.py holds what these tools share.
Reads: the built unit (a traced or planted build where asked). Writes: reports/sanitize.json,
reports/*.ncu-rep, reports/phases-*.json.
"""
