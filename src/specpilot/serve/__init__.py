"""OpenAI-compatible HTTP serving of a SpecPilot engine (FastAPI + uvicorn, imported lazily)."""
