"""The pipeline that gates the library: env, build, test (gates), bench, report, sanitize, profile.

Every command runs as `python -m flashmoe_science COMMAND`; imports point from here to the library
(`flashmoe_science.ops`), never back."""
