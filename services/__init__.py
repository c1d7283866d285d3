"""The modalmesh services: audio_encoder, vision_encoder, llm, vae (gRPC) and gateway (HTTP).

Each builds on the shared runtime (modalmesh/); the runtime never imports a service and
no service imports another (services/encoder is the vision and audio encoders' shared
layer, not a service). docs/architecture.md is the map.

One shape for a service package::

    services/<name>/
      __init__.py   the package map: one line per module, as below
      __main__.py   `python -m services.<name>`: `sys.exit(run(TheService))` (modalmesh.service.run:
                    the process shell, flags also MODALMESH_*); `--help` is answered first,
                    from flags.py, without importing the model stack
      flags.py      the service's flags (NAME, DESCRIPTION, `add_arguments`, `parser()`),
                    declared without torch; the Service subclass's `add_arguments` is this
      server.py     thin: the Service subclass (flags, load, close, Info, one method per RPC
                    turning a typed job into the reply) registered with the one servicer,
                    modalmesh.rpc.servicer.ForwardingServicer; no validation, no batching
      config.py     the service's frozen config, built once from the flags (and the
                    checkpoint's config); everything below server.py takes this value,
                    never `args`
      inputs.py     request -> typed job, with every check a request can fail
                    (INVALID_ARGUMENT); the wire types stop here
      batcher.py    the batching policy on modalmesh.batching.BatchQueue (encoders, VAE),
      engine.py     or the engine that runs jobs on the model (LLM: continuous batching)
      models/       the architectures, one file per family, and the package's
                    `ARCHITECTURES` tuple a checkpoint's config picks from

Where a package differs, and why:

- audio_encoder, vision_encoder: server.py subclasses services/encoder's EncoderService,
  which owns the shared flags (encoder/flags.py; encoder/config.py freezes them), the batcher, the cache and the servicer;
  their inputs are the model's `prepare` (vision_encoder/preprocess.py,
  audio_encoder/audio.py + features.py), run per item in a thread pool.
- llm: inputs.py (tokenisation, placeholder runs), sampling.py (sampling parameters) and
  limits.py (request limits) hold its request checks; engine.py, scheduler.py and runner.py its engine.
- gateway: HTTP, not gRPC, and no model: server.py holds the aiohttp routes, config.py its
  flags, protocol.py / media.py / latents.py its inputs (OpenAI JSON -> gRPC requests);
  its process shell is the services' (modalmesh.service.run_process).
"""
