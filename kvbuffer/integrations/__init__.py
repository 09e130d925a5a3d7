"""kvbuffer inside other servers' models.

`kvbuffer.integrations.transformers` makes Hugging Face transformers' hybrid models decode through
kvbuffer's buffered ops; docs/integrations.md maps out vLLM and SGLang. Nothing here is imported
by `import kvbuffer`: each submodule imports the framework it integrates with.
"""
