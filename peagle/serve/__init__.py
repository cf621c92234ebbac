"""`peagle serve`: an OpenAI- and SageMaker-compatible HTTP server over the speculative decoding engine.

- `protocol`: request/response schemas (OpenAI's shape) and the error shape
- `async_engine`: the engine in a background thread, per-request asyncio streams, admission and drain
- `app`: the FastAPI routes (chat, completions, SSE, models, health/ping, invocations, metrics, playground)
- `metrics`: Prometheus metrics with vLLM's names
- `cli`: `peagle serve`; `catalog`: `peagle models`; `endpoints`: `peagle deploy / endpoints / delete`

Nothing heavy is imported here, so `peagle models` or a refused config answer without loading torch.
"""

__all__ = ["AsyncEngine", "build_app"]


def __getattr__(name):
    if name == "build_app":
        from peagle.serve.app import build_app

        return build_app
    if name == "AsyncEngine":
        from peagle.serve.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
