"""The four modalmesh services: audio_encoder, vision_encoder, llm, vae."""
