"""The pipeline that gates the library, one subpackage per stage, in the order a run takes them:

    env/     is the machine fit? (reports/env.json)
    build/   the extension as one compilation unit (build/<key>/, reports/build.json)
    gates/   correctness over the sequence-length x head-dim matrix (reports/gates.json)
    bench/   speed against PyTorch SDPA on the same card (reports/bench.json, bench.md)
    tools/   compute-sanitizer, Nsight Compute and phase traces on one build or case
    ci/      GPU CI's own steps: approval, change-aware selection, status, bench history
    report/  one markdown report of the run (reports/report.md, the PR comment)

The modules at this level are what the stages share: cli (the command line), exitcodes, paths,
provenance, stages (each stage's wall time), cases (case ids and inputs), gpukinds, load (the
machine's load around a stage), markdown.
Every command runs as `python -m flashmoe_science COMMAND`. Imports point down: a stage imports
the shared modules and the stages listed above it, everything may import the library
(`flashmoe_science.ops`, `_loader`), and the library never imports the pipeline
(tests/test_imports.py holds this, and that there is no import cycle)."""
