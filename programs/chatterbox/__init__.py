"""Chatterbox (Resemble AI): T3, a Llama speech-token LM with classifier-free guidance."""
