"""What the tests and the benchmarks share (as numpy.testing): real server processes on 127.0.0.1 and their
metrics (server), an LLMEngine whose executor needs no model (stub_engine) behind the real gateway (stub_server),
and the schema fuzzing and soak drivers (fuzz, soak). Needs the `test` extra (httpx, schemathesis); nothing
else in servelab imports it."""
