"""Subcommands of the ``specpilot`` CLI; each module has ``add_parser`` and ``run``."""
