"""LLM service: streaming multimodal generation over a paged KV pool, sharded over GPUs (LLMService).

    python -m services.llm --model DIR [--tensor-parallel-size N] [--vision-encoder T] [--audio-encoder T]

    flags.py        the service's flags, declared without torch (`--help` answers before the model stack)
    limits.py       RequestLimits: what one request may ask (stop strings, stop ids, items)
    config.py       LLMConfig: every setting, one frozen value built from the flags, replaced per rank
    server.py       LLMService: the gRPC edge (its own process); streams each call's deltas from the engine process
    engine_client.py  EngineClient: the edge's handle on the engine process (start, calls, Info, metrics, stop)
    link.py         the edge <-> engine process link: framed messages, one frame of deltas per engine step
    core.py         EngineCore: the engine process; tokenise, validate, resolve items, add to the engine
    inputs.py       request -> typed prompt: tokenisation, placeholder runs, rows counted before encoding
    embedding.py    Embedding: every item's embedding (a client's or an encoder's) as one value on the device
    encoders.py     the encoder pools (round_robin; paths and fallbacks from modalmesh.rpc.transfer), the fan-out
    engine.py       LLMEngine: the worker thread, one step ahead (schedule and submit step N+1, then
                    read back, detokenise and emit step N)
    request.py      RequestState and Delta: one request inside the engine
    scheduler.py    continuous batching over the page allocator, pure Python
    runner.py       ModelRunner: the model on one rank (launch / submit / call / loop / execute)
    step_inputs.py  StepInputs and StepChannel: one step's inputs as one message, to every rank
    graphs.py       steps replayed from CUDA graphs: decode per batch bucket, mixed per token bucket
    tp.py           RankWorkers: ranks 1..N-1 as child processes of rank 0
    sampling.py     SamplingParams, RequestLimits and the batched sampler
    stops.py        stop strings matched incrementally (Aho-Corasick)
    detokenizer.py  incremental detokenisation that never leaks a stop string
    loader.py       load_llm: checkpoint -> model, strictly
    models/         the language models (Llama, Qwen2/3, GPT-NeoX, the LMs of Qwen2-VL / Qwen2-Audio)
"""
