"""Stage 2, build: the extension as one compilation unit.

unit.py is `python -m flashmoe_science build` over the loader (flashmoe_science._loader), which
compiles and caches the unit; compiler_output.py reads what nvcc and ptxas printed (resources,
spills, the first error); wheelcheck.py installs the package as a user would and calls both APIs.
Reads: csrc/, the toolchain. Writes: build/<key>/ (the library), reports/build.json, build.log.
"""
