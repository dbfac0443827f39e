"""Optional integrations of flashtune with other libraries.

Each submodule imports its library only when used: `import flashtune` never imports them.
`flashtune.integrations.transformers`: an attention implementation for Hugging Face transformers.
"""
