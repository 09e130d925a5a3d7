"""Typed errors: every bad input names the problem, and callers can catch one family.

Each error derives from the builtin that a Python user would expect (a wrong shape is a
ValueError, a wrong dtype a TypeError, a bad slot an IndexError), and from KVBufferError so
that a server can catch everything kvbuffer raises in one clause.
"""


class KVBufferError(Exception):
    """Base class of every error kvbuffer raises on purpose."""


class ShapeError(KVBufferError, ValueError):
    """A tensor has the wrong shape or rank."""


class DTypeError(KVBufferError, TypeError):
    """A tensor has the wrong dtype."""


class DeviceError(KVBufferError, ValueError):
    """Tensors that must live together are on different devices."""


class SlotError(KVBufferError, IndexError):
    """A slot index is out of range, not allocated, freed twice, or used where a real slot is needed."""


class ExpertIndexError(KVBufferError, IndexError):
    """An expert id outside the experts a weight holds."""


class PoolExhaustedError(KVBufferError, RuntimeError):
    """No free slot is left in a pool; the caller should wait for one to be freed."""


class BufferOverflowError(KVBufferError, ValueError):
    """An operation would write past a request's buffer capacity (flush first)."""


class ArtifactError(KVBufferError, RuntimeError):
    """A compiled kernel artifact is missing, corrupt or built for another machine."""


class CheckpointError(KVBufferError, ValueError):
    """A checkpoint cannot be loaded as it is (bad config.json, unreadable or inconsistent weights);
    the message names the file or tensor."""


class QueueFullError(KVBufferError, RuntimeError):
    """Too many requests already wait for a slot; try again later (a server answers 503)."""


class RequestError(KVBufferError, ValueError):
    """One request of a batch failed on its own (its logits were NaN or infinite, or its sampling
    failed) and was finished with finish_reason "error"; the other requests completed. The message
    names the request (generate(): the prompt's index)."""
