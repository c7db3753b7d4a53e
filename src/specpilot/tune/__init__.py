"""The factory: search lossless mechanisms and knobs per deployment, gated by token forcing."""
