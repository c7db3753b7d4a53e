"""Benchmarks: prompt sets, and (elsewhere in this package) bench and compare."""

from specpilot.bench.prompts import Prompt, list_prompt_sets, load_prompt_set

__all__ = ["Prompt", "list_prompt_sets", "load_prompt_set"]
