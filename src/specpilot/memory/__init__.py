"""The structured memory: what was tried on which deployment, and what was validated (SQLite)."""

from specpilot.memory.fingerprint import Fingerprint, fingerprint_deployment
from specpilot.memory.kernels import KernelRow
from specpilot.memory.store import MemoryStore, TrialRow

__all__ = ["Fingerprint", "KernelRow", "MemoryStore", "TrialRow", "fingerprint_deployment"]
