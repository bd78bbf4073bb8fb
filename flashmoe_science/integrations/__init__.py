"""Plug-ins for model libraries. Each module imports its library lazily, on first use:
`flashmoe_science.integrations.transformers` (Hugging Face transformers' AttentionInterface)."""
