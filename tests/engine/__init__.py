"""The engine: admission, scheduling, options, speculative decoding, decode graphs, the plan."""
