"""Free-slot counts of an engine's pools, to check that a rejected or finished call took nothing."""


def _allocators(llm):
    c = llm.runner.caches
    return [p for p in (c.requests, c.states and c.states.slots, c.buffers and c.buffers.slots,
                        c.convs and c.convs.slots) if p is not None]


def free_slots(llm) -> list[int]:
    return [p.num_free for p in _allocators(llm)]


def all_free(llm) -> bool:
    return free_slots(llm) == [p.capacity for p in _allocators(llm)]
