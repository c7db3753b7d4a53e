"""Fused decode kernels: Triton on CUDA, each with the torch reference its tests compare against.

``reference`` holds the torch versions (used on the CPU and as the ground truth); ``decode_triton``
holds the Triton kernels and imports triton, so only import it when :func:`triton_usable` says so.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_usable(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices, or anywhere under ``TRITON_INTERPRET=1`` (tests)."""
    if os.environ.get("SPECPILOT_NO_TRITON") == "1":
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
