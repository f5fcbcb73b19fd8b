"""Property tests of DSV4 payloads (hypothesis, fixed seed): sessions of any length round-trip
through a file bit for bit; any mutation of a file (a flipped byte, a truncation, bytes added, a
header field set to any u32) is refused with PayloadError and leaves the target session as it
was, except a change inside the trailer's informational model name, which may also load; the
receiver's cheap check and the trailer reader only ever raise PayloadError."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from ds4.core import payload as pl
from ds4.core.payload import PayloadError
from ds4.core.tiny import make_tiny

CTX = 64
HYP = settings(max_examples=50, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HEADER_FIELDS = 13
PER_MILLE = 1000
FOOTER = 88  # the identity trailer's fixed part, after the model name


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    return ds4.Engine.open(make_tiny(tmp_path_factory.mktemp("m") / "m.gguf", preset="test", seed=1))


@pytest.fixture(scope="module")
def files(eng) -> dict[int, bytes]:
    """Payload files (with the identity trailer) after a few prompt lengths."""
    rng = np.random.default_rng(23)
    out = Files()
    for n in (1, 4, 21, 40):
        s = eng.session(ctx=CTX)
        s.sync([int(x) for x in rng.integers(0, 512, n)])
        f = io.BytesIO()
        s.save_payload(f)
        out[n] = f.getvalue()
    return out


class Files(dict):
    """The payload files by prompt length, with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return f"Files({sorted(self)})"


def session_state(s):
    snap = s.snapshot()
    return snap.tokens, snap.logits, snap.arrays


def assert_unchanged(s, before):
    tokens, logits, arrays = session_state(s)
    assert tokens == before[0] and np.array_equal(logits, before[1])
    for il in arrays:
        for name in arrays[il]:
            assert np.array_equal(arrays[il][name], before[2][il][name], equal_nan=True), (il, name)


@pytest.fixture(scope="module")
def target(eng):
    """A session holding another sequence, loaded into (and re-synced after a load)."""
    s = eng.session(ctx=CTX)
    s.sync([5, 6, 7])
    return s, session_state(s)


@HYP
@given(tokens=st.lists(st.integers(0, 511), min_size=1, max_size=CTX - 1), version=st.sampled_from([1, 2]))
def test_any_session_round_trips_through_a_file(eng, tokens, version):
    s = eng.session(ctx=CTX)
    s.sync(tokens)
    f = io.BytesIO()
    n = s.save_payload(f, version=version)
    data = f.getvalue()
    assert n == len(data)
    t = eng.session(ctx=CTX)
    t.load_payload(data)
    assert t.tokens == tokens and np.array_equal(t.logits, s.logits)
    g = io.BytesIO()
    t.save_payload(g, version=version)
    assert g.getvalue() == data


def _mutations():
    # positions as per-mille of the file (plus a jitter), so that mutations land all over it
    where = st.tuples(st.integers(0, PER_MILLE - 1), st.integers(0, 4095))
    flip = st.tuples(st.just("flip"), where, st.integers(1, 255))
    cut = st.tuples(st.just("cut"), where, st.just(0))
    add = st.tuples(st.just("add"), st.integers(1, 64), st.integers(0, 255))
    field = st.tuples(st.just("field"), st.integers(0, HEADER_FIELDS - 1),
                      st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2, 63, 64, 2**31])))
    return st.one_of(flip, cut, add, field)


def _position(where: tuple[int, int], size: int) -> int:
    per_mille, jitter = where
    return (per_mille * size // PER_MILLE + jitter) % size


def mutate(data: bytes, kind: str, a: int, b: int) -> tuple[bytes, int | None]:
    """(mutated bytes, the offset changed or None)."""
    if kind == "flip":
        at = _position(a, len(data))
        return data[:at] + bytes([data[at] ^ b]) + data[at + 1:], at
    if kind == "cut":
        return data[: _position(a, len(data))], None
    if kind == "add":
        return data + bytes([b]) * a, None
    old = struct.unpack_from("<I", data, 4 * a)[0]
    return data[: 4 * a] + struct.pack("<I", b) + data[4 * a + 4:], (4 * a if b != old else -1)


@HYP
@given(n=st.sampled_from([1, 4, 21, 40]), m=_mutations())
def test_a_mutated_file_is_refused_and_changes_nothing(eng, files, target, n, m):
    data = files[n]
    bad, at = mutate(data, *m)
    if at == -1:  # the field already had that value
        return
    name_bytes = struct.unpack_from("<I", data, len(data) - 16)[0]
    in_name = at is not None and len(data) - FOOTER - name_bytes <= at < len(data) - FOOTER
    s, before = target
    try:
        s.load_payload(bad)
    except PayloadError:
        assert_unchanged(s, before)
    else:
        s.sync([5, 6, 7])
        assert in_name, f"a mutated file loaded: {m}"
    try:
        pl.check_payload(bad, eng.config, len(bad))
    except PayloadError:
        pass


@HYP
@given(n=st.sampled_from([1, 21]), m=_mutations())
def test_a_mutated_bare_header_is_refused_or_loads(eng, files, target, n, m):
    """Without the trailer only the structure is checked: header fields, counts and sizes."""
    data = files[n]
    body = data[: struct.unpack_from("<Q", data, len(data) - 24)[0]]
    if m[0] == "flip":  # flips inside float data are what the trailer's checksum is for
        m = ("flip", (0, m[1][1] % pl.HEADER_BYTES), m[2])
    bad, at = mutate(body, *m)
    if at == -1:
        return
    s, before = target
    try:
        s.load_payload(bad)
    except PayloadError:
        assert_unchanged(s, before)
    else:
        s.sync([5, 6, 7])
        assert m[0] in ("flip", "field")
        assert len(bad) == len(body)


@HYP
@given(blob=st.binary(max_size=300), tail=st.booleans())
def test_arbitrary_bytes_are_refused_with_payload_error(eng, files, blob, tail):
    data = blob + files[1][-(FOOTER + 6):] if tail else blob  # sometimes ending in a trailer
    with pytest.raises(PayloadError):
        eng.session(ctx=CTX).load_payload(data)
    try:
        pl.read_identity(data)
        pl.check_payload(data, eng.config, len(data))
    except PayloadError:
        pass
