"""bench/triton/settings.py: backend settings from a benchmark's command line are checked against
the backend's attributes before any is set."""

from __future__ import annotations

import types

import pytest

from bench_modules import bench_module


@pytest.fixture(scope="module")
def settings():
    return bench_module("triton", "settings")


def _backend():
    return types.SimpleNamespace(name="triton", f16_x2=True, lanes=6)


def test_apply_sets_known_attributes(settings):
    be = _backend()
    settings.apply_settings(be, {"f16_x2": False, "lanes": 0}, "--set")
    assert (be.f16_x2, be.lanes) == (False, 0)


def test_a_misspelt_name_stops_the_run_and_sets_nothing(settings):
    be = _backend()
    with pytest.raises(SystemExit, match=r"--set: the triton backend has no attribute 'f16x2'"):
        settings.apply_settings(be, {"lanes": 0, "f16x2": False}, "--set")
    assert be.lanes == 6 and not hasattr(be, "f16x2")


def test_session_keys_pass_only_where_named(settings):
    be = _backend()
    settings.check_settings(be, {"prefill_cap": 8192}, "--prefill-variants cap", settings.SESSION_KEYS)
    with pytest.raises(SystemExit, match=r"--variants cap: the triton backend has no attribute 'prefill_cap'"):
        settings.check_settings(be, {"prefill_cap": 8192}, "--variants cap")
