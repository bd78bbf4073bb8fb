"""Stage 4, bench: how fast, against PyTorch SDPA on the same card in the same run?

run.py is `python -m flashmoe_science bench`: matrix.py picks the cases, measure.py and timing.py
time ours and the baselines (baselines.py; flex.py: FlexAttention, the baseline of the sliding
window, softcap and sinks cases) in interleaved rounds, readfloor.py times a bare read of
the KV cache, target_cases.py and target_measure.py time the speed targets that targets.py judges,
headbase.py compares two commits, stats.py holds the statistics. records.py types bench.json;
summary.py writes bench.md; history.py and trend.py keep the runs over time.
Reads: the built unit. Writes: reports/bench.json, reports/bench.md, and the run's samples to
<build root>/bench-history/ (history.py; --history DIR moves it).
"""
