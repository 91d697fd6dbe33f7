"""`specsched serve`: an OpenAI-compatible HTTP server over one AsyncEngine, with Prometheus metrics.

protocol.py: the request bodies (pydantic, unknown and unsupported fields refused by name);
metrics.py: the Prometheus metrics, spec-decode counters under vLLM's names; app.py: the
FastAPI application and its routes; docs/runtime.md#http-server says why FastAPI and uvicorn.
"""
