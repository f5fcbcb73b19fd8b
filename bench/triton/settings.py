"""Backend settings from a benchmark's command line (`--set`, `--variants`): JSON
{backend attribute: value}, checked against the attributes the Triton backend has, so a misspelt
name stops the run instead of measuring the unchanged backend under the variant's name."""

from __future__ import annotations

SESSION_KEYS = ("prefill_cap",)  # prefill variant keys that set the session, not the backend


def check_settings(backend, settings: dict, flag: str, session_keys: tuple = ()) -> None:
    """Stop the run (naming flag) if a key of settings is neither a backend attribute nor one of
    session_keys."""
    for k in settings:
        if k not in session_keys and not hasattr(backend, k):
            raise SystemExit(f"{flag}: the {backend.name} backend has no attribute {k!r}")


def apply_settings(backend, settings: dict, flag: str) -> None:
    """Set each backend attribute of settings, once all of them are checked."""
    check_settings(backend, settings, flag)
    for k, v in settings.items():
        setattr(backend, k, v)
