"""The server's request limits, in a module that imports nothing: `kvbuffer serve --help` shows
them without loading the server's dependencies."""

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # a max_len prompt as token ids fits well under it; bounds one parse's stall
