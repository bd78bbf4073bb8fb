"""The pipeline that gates the library, one subpackage per stage, in the order a run takes them:

    env/     is the machine fit? (reports/env.json)
    build/   the extension as one compilation unit (build/<key>/, reports/build.json)
    gates/   correctness over the sequence-length x head-dim matrix (reports/gates.json)
    bench/   speed against PyTorch SDPA on the same card (reports/bench.json, bench.md)
    report/  one markdown report of the run (reports/report.md, the PR comment)
    ci/      GPU CI's trusted steps, run from main's code (approval, status, bench history)
    tools/   compute-sanitizer, Nsight Compute and phase traces on one build or case

The modules at this level are what the stages share: cli (the command line), exitcodes, paths,
provenance, stages (each stage's wall time), cases (case ids and inputs), gpukinds, markdown.
Every command runs as `python -m flashmoe_science COMMAND`. Imports point down, from here to the
library (`flashmoe_science.ops`), never back, and no stage imports a later one except report and
ci, which read every stage's records."""
