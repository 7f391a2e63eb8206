"""The model as data: loading it (bundled GGUF, local checkpoints, hub ids), rendering prompts with its
chat template, fitting a conversation into its context, and what its KV cache costs."""
