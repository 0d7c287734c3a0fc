"""Profiles: ``<model>:<profile>`` ids -> per-request setting overlays on one engine.

A profile is a named bundle of `ModelSettings.PROFILE_KEYS` (sampling defaults, output cap,
thinking default, tool dialect) declared under ``[models."<id>".profiles.<name>]``. Requests to
``<id>:<name>`` run on the engine of ``<id>`` with those settings laid over the model's own: no
second copy of the weights, no reload.

Must not: load anything or know about engines; it only parses ids and merges settings.
"""

from __future__ import annotations

from omlx.config import PROFILE_KEYS, ModelSettings

SEPARATOR = ":"


def split_profile_id(model: str) -> tuple[str, str] | None:
    """``"smol:precise"`` -> ``("smol", "precise")``; None when there is no ``:`` to split at.

    The split is at the last ``:``, so an alias that itself contains ``:`` (``llama3:8b``) is
    looked up whole first by the caller.
    """
    base, sep, name = model.rpartition(SEPARATOR)
    if not sep or not base or not name:
        return None
    return base, name


def profile_id(model_id: str, profile: str) -> str:
    return f"{model_id}{SEPARATOR}{profile}"


def overlay(base: ModelSettings, profile: ModelSettings) -> ModelSettings:
    """``base`` with every profile field that is set (not None) replacing the model's value.

    Returns:
        A new ModelSettings whose ``profiles`` is empty (an overlay is not itself a model).
    """
    changes = {k: getattr(profile, k) for k in PROFILE_KEYS if getattr(profile, k) is not None}
    return base.model_copy(update={"profiles": {}, **changes})


def effective_settings(base: ModelSettings, profile: str | None) -> ModelSettings | None:
    """The settings a request to ``<model>:<profile>`` runs with; None if no such profile."""
    if profile is None:
        return base
    p = base.profiles.get(profile)
    return overlay(base, p) if p is not None else None


def describe(settings: ModelSettings) -> dict[str, object]:
    """The per-request fields that are set, for ``/v1/models/status``."""
    return {k: getattr(settings, k) for k in type(settings).model_fields
            if k in PROFILE_KEYS and getattr(settings, k) is not None}
