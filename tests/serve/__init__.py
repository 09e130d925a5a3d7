"""`kvbuffer serve`: the OpenAI-compatible server, its engine loop and its benchmark."""
