"""Drafter kind name → its training recipe (``train/recipe.Recipe``), imported on demand: the
one place that knows every kind's module."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specpilot.train.recipe import Recipe


def recipes() -> dict[str, Recipe]:
    """Kind name → recipe (the names of ``train/settings.KIND_NAMES``)."""
    from specpilot.train.dflash_recipe import DFlashRecipe
    from specpilot.train.eagle3_recipe import Eagle3Recipe

    return {"dflash": DFlashRecipe(), "eagle3": Eagle3Recipe()}
