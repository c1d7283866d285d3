"""Vision encoder service: images and videos -> embedding rows for the LLM (EncoderService, modality IMAGE).

    python -m services.vision_encoder --model DIR [--max-batch-tokens N] [--max-image-pixels N]
                                      [--max-request-pixels N] [--siglip-output patch|pooled|both]
                                      [--preprocess-device auto|cpu|device] [--image-decode auto|pil|nvimgcodec]
                                      [--video-fps F] [--max-video-frames N] [--max-video-seconds S]

    preprocess.py   decoding and HF-exact preprocessing (rescale, normalise, patchify; the grid in
                    modalmesh/image_grid.py), a video's frames and temporal patches included
    video.py        video files (PyAV, the extra modalmesh[video]) -> the frames HF's video processor samples
    device_preprocess.py  the same preprocessing in torch on the encoder's device (uint8 uploaded once
                    per batch; resize, normalise, patchify there), within a stated tolerance of preprocess.py
    device_decode.py  JPEGs decoded on the encoder's GPU (nvImageCodec), batched, in the worker; PIL for the rest
    decode_memory.py  decoded-bytes limits and the decode memory budget shared by preparing threads
    models/         the towers: Qwen2-VL, Qwen2.5-VL (window attention), SigLIP; architecture only
    model.py        VisionEncoderModel: the shared encoder contract (prepare / encode), either path
    flags.py        the encoder flags plus the tower's, declared without torch (`--help`)
    server.py       VisionEncoderService: the shared EncoderService plus its flags and Info facts
"""
