"""The OpenAI-compatible HTTP gateway: a thin fourth service in front of the scheduler's public
gRPC API (picovllm.scheduler.v1). It holds no engine state: each HTTP request becomes one
streamed `Generate` call per prompt, and a client that goes away cancels that call, which
aborts the request in the scheduler and frees its KV-cache blocks.

    picovllm serve http      # alone, in front of a running scheduler
    picovllm serve all       # the fourth child of the one-machine deployment

Modules: protocol (the request bodies, pydantic), errors (OpenAI's error object, status
codes), backend (the gRPC channel, model info, the tokenizer), convert (request -> gRPC,
gRPC -> response objects), routes (the endpoints), app (middleware, metrics, the FastAPI
app), server (uvicorn, start-up), health (the container healthcheck).
"""
