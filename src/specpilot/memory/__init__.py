"""The structured memory: what was tried on which deployment, and what was validated (SQLite)."""

from specpilot.memory.fingerprint import Fingerprint, fingerprint_deployment
from specpilot.memory.store import MemoryStore, TrialRow

__all__ = ["Fingerprint", "MemoryStore", "TrialRow", "fingerprint_deployment"]
