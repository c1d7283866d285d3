"""What the vision and the audio encoder share: the model contract, batching, the cache, the servicer."""
