"""The OpenAI-compatible HTTP front of the stack (`python -m services.gateway`; docs/gateway.md).

    config.py     the flags (modalmesh.flags' process flags + its own) and GatewayConfig, frozen
    server.py     Gateway: the aiohttp routes, middleware (errors, auth, metrics), /health, the drain;
                  `main` runs it in the services' process shell (modalmesh.service.run_process)
    protocol.py   OpenAI request bodies -> GenerateRequest, GenerateResponse deltas -> OpenAI responses
    media.py      image / audio parts: data URLs, local files, size limits
    latents.py    latents uploads -> pb.Tensor, and the upload's options -> DecodeRequest
    errors.py     APIError in OpenAI's error shape; gRPC status -> HTTP status
    backends.py   the gRPC clients of the LLM and the VAE, their health followed live
    launch.py     GatewayProcess: the gateway as a child process (tests, local stacks)
"""
