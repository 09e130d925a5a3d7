"""Engine defaults and limits that layers below the engine (the planner, the benchmarks) also need."""

DEFAULT_CHUNK_SIZE = 16  # buffer entries folded per flush (C) where no tuning record chooses one
MAX_DRAFT_TOKENS = 16  # most draft tokens a speculative step verifies
MODES = ("kvbuffer", "recurrent")  # how a decode step runs the linear layers: buffered, or one recurrent update
