"""`kvbuffer serve`: an OpenAI-compatible HTTP server on the step-able engine.

http.py reads a request's body (size limit, strict parse), answers every error as OpenAI's error
object and checks the API key; limits.py holds the request limits' defaults; schemas.py checks
requests (unknown fields are errors, no coercion), chat.py turns messages into a prompt,
engine_loop.py runs the engine in one background thread that admits requests as they arrive,
stream.py turns one request's tokens into text pieces, app.py has the routes, metrics.py the
Prometheus metrics, benchmark.py the serving benchmark. Needs the `serve` extra.
"""
