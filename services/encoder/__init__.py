"""What the vision and the audio encoder share: the model contract, the service, its config, batching, the cache.

    model.py      EncoderModel: the contract (prepare on the CPU, encode a batch on the device)
    service.py    EncoderService: flags, load, Info; Encode = prepare -> cache -> batch -> answer,
                  registered with modalmesh.rpc.servicer.ForwardingServicer
    flags.py      the flags both encoders share (no torch: `--help` is instant)
    config.py     EncoderServiceConfig: the shared flags (and the tower's options), frozen, built once
    batcher.py    Batcher: the token-budget batching policy on modalmesh.batching.BatchQueue
    cache.py      EmbeddingCache: finished embeddings, LRU, bounded in bytes
"""
