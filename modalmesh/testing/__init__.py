"""Test and demo fixtures; nothing here is imported by a serving process.

    tiny.py   deterministic tiny random checkpoints of every supported architecture, made
              with the reference classes (transformers; diffusers for the VAE: the [demo] extra)
"""
