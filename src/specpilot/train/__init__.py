"""Drafter training: data (ShareGPT prompts, target-regenerated responses), target features
online, the DFlash block loss, resumable checkpoints, held-out τ through the real engine."""
