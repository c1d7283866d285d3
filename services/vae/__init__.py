"""VAE decoder service: diffusers AutoencoderKL decoders behind modalmesh.v1.VAEService (docs/vae.md).

    python -m services.vae --model DIR [--max-batch N] [--tile-size N] [--dtype float32|bfloat16]

    flags.py      the service's flags, declared without torch (`--help` answers before the model stack)
    config.py     VAEConfig (the checkpoint's config.json, frozen) and VAEServiceConfig (the flags, once)
    server.py     VAEDecoderService: flags, load, Info; Decode = inputs -> batcher -> reply
    inputs.py     DecodeRequest -> DecodeJob: every check, unscaling; the wire types stop here
    batcher.py    DecodeBatcher: jobs of one latent shape and tiling per decoder call (on
                  modalmesh.batching), and what the worker thread does with a batch
    engine.py     VAEEngine: decode plan (untiled / tiled, memory budget), CUDA graphs of the tile's shape,
                  post-processing, PNG
    tiling.py     the tile grid and the cross-faded tiled decode
    weights.py    checkpoint names -> decoder, as data; build and load
    models/       the AutoencoderKL decoder, architecture only
"""
