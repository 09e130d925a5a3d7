"""The model loaders, checked token for token against transformers, and bad checkpoints."""
