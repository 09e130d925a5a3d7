"""The transformers integration: kvbuffer as a cache behind `model.generate`."""
