"""Errors a user can cause. Each carries one sentence that says what is wrong and what to do.

The CLI prints ``str(err)`` and exits with status 2; no traceback reaches the user.
"""


class SpecPilotError(Exception):
    """Base class for user-facing errors (bad input, missing files, incompatible models)."""


class CheckpointError(SpecPilotError):
    """A model file or directory is missing, truncated, corrupt or of an unsupported kind."""


class IncompatibleDrafterError(SpecPilotError):
    """The drafter cannot serve this target (e.g. another vocabulary)."""


class PromptTooLongError(SpecPilotError):
    """A prompt (plus the tokens asked for) does not fit the engine's context."""


class FetchError(SpecPilotError):
    """A model or prompt set could not be fetched from its package."""
