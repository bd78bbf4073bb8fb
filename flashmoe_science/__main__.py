"""`python -m flashmoe_science COMMAND`. In an installed package, `build` prebuilds the per-user
cache (the loader's command); in a checkout every command is the pipeline's."""

import sys

from . import _loader

if sys.argv[1:2] == ["build"] and _loader.installed():
    sys.exit(_loader.main(sys.argv[2:]))

from .pipeline.cli import main

sys.exit(main())
