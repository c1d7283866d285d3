"""Audio encoder service: audio -> embedding rows for the LLM (EncoderService, modality AUDIO).

    python -m services.audio_encoder --model DIR [--max-audio-seconds S] [--whisper-rows valid|full]
                                  [--preprocess-device auto|cpu|device]

    audio.py      decoding (WAV / FLAC / OGG) or raw PCM, downmix, resampling: the item's inputs
    features.py   Whisper log-mel features, equal to transformers' WhisperFeatureExtractor
    device_features.py  resampling + log-mel of a batch on the encoder's device (--preprocess-device)
    models/       the towers: Whisper encoder, Qwen2-Audio tower + projector; architecture only
    model.py      AudioEncoderModel: the shared encoder contract (prepare / encode)
    flags.py      the encoder flags plus the tower's, declared without torch (`--help`)
    server.py     AudioEncoderService: the shared EncoderService plus its flags and Info facts
"""
