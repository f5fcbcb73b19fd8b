"""The DSV4 session payload (spec ds4-model.md §4.1, §4.2): the byte contract between nodes.

    s.save_payload("snap.dsv4")      # prefill node
    s2.load_payload("snap.dsv4")     # decode node: s2.logits are the saved next-token logits

Layout (all little-endian, no padding): a 13 × u32 header, T u32 tokens, `vocab` f32 logits of
the next token, `n_layer` u32 compressed-row counts, `n_layer` u32 indexer-row counts, then per
layer: the last `raw_live` raw K=V rows in logical order (oldest first); on compressed layers the
compressed rows and the compressor frontier (state_kv, state_score); on ratio-4 layers the
indexer rows and the indexer frontier. Every tensor is float32; a payload is portable between
backends because each one writes and reads exactly the float32 state it keeps.

Version 2 is written (its body is version 1's, as upstream ds4 emits it); versions 1 and 2 are
read, and a version-2 payload may carry the 16-byte MTP-statistics tail of spec §4.2 (read and
dropped: ds4 keeps no MTP state, so a re-saved payload is the tail-less version 2).

Files end with ds4's identity trailer (payload_identity.py): the model's fingerprint and a
SHA-256 of the body, checked on load; `identity=False` writes the bare body. A payload with no
tokens is refused on load as on save.

Loading parses and validates everything into host buffers first (sizes are checked before
anything is allocated or read) and only then writes the session, so a rejected payload leaves the
session exactly as it was. The error messages are ds4's (`ds4_session_load_payload`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import struct
from dataclasses import dataclass, field
from typing import IO, Iterator

import numpy as np

from .atomic import atomic_file
from .payload_identity import (E_CHECKSUM, E_IDENTITY, E_MODEL, Identity, ModelRef,  # noqa: F401
                               PayloadError, _check_digest, _fail, check_model, read_identity,
                               trailer_start, verify_digest)
from .config import CSA, ModelConfig
from .state import SessionLayout, host_layer_state, layer_from_host

MAGIC = 0x34565344  # b"DSV4"
VERSION = 2  # written
VERSIONS = (1, 2)  # read
_EXPECTED_VERSION = f"expected {MAGIC:#010x}, version {' or '.join(map(str, VERSIONS))}"
HEADER = struct.Struct("<13I")
HEADER_BYTES = HEADER.size  # 52
MTP_TAIL = struct.Struct("<IdI")  # u32 mtp_accept_gate_skip, f64 mtp_accept_ewma, u32 samples
MTP_TAIL_BYTES = MTP_TAIL.size  # 16

# ds4's loader messages (spec §4.1), plus two of ours for what ds4 leaves to fread failures.
E_VERSION = "unsupported session payload version"
E_FIT = "KV checkpoint does not fit current context"
E_LAYOUT = "KV checkpoint was written for a different DS4 layout"
E_CHUNK = "KV checkpoint graph chunk layout does not match current runtime"
E_RING = "KV checkpoint raw ring layout does not match current context"
E_COMP_CAP = "KV checkpoint compressed cache is larger than current context"
E_COMP_ROWS = "KV checkpoint has invalid compressed row count"
E_INDEX_ROWS = "KV checkpoint has invalid indexer row count"
E_TRAILING = "KV checkpoint has trailing payload bytes"
E_MISSING = "KV checkpoint is missing payload bytes"
E_TOKEN = "KV checkpoint has an invalid token id"
E_EMPTY = "KV checkpoint holds no tokens"


# ---- header -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Header:
    version: int
    ctx: int
    prefill_cap: int
    raw_cap: int
    raw_window: int
    comp_cap: int
    n_tokens: int
    n_layer: int
    head_dim: int
    indexer_head_dim: int
    vocab: int
    raw_live: int
    magic: int = MAGIC

    def pack(self) -> bytes:
        return HEADER.pack(self.magic, self.version, self.ctx, self.prefill_cap, self.raw_cap,
                           self.raw_window, self.comp_cap, self.n_tokens, self.n_layer,
                           self.head_dim, self.indexer_head_dim, self.vocab, self.raw_live)

    @classmethod
    def unpack(cls, data: bytes) -> "Header":
        (magic, version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, n_tokens, n_layer,
         head_dim, indexer_head_dim, vocab, raw_live) = HEADER.unpack(data)
        return cls(version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, n_tokens, n_layer,
                   head_dim, indexer_head_dim, vocab, raw_live, magic)

    @classmethod
    def for_session(cls, cfg: ModelConfig, layout: SessionLayout, n_tokens: int,
                    version: int = VERSION) -> "Header":
        return cls(version, layout.ctx, layout.prefill_cap, layout.raw_cap, layout.raw_window,
                   layout.comp_cap, n_tokens, cfg.n_layer, cfg.head_dim, cfg.indexer_head_dim,
                   cfg.n_vocab, raw_live(layout, n_tokens))

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.n_layer, self.head_dim, self.indexer_head_dim, self.vocab)


def model_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    return (cfg.n_layer, cfg.head_dim, cfg.indexer_head_dim, cfg.n_vocab)


def raw_live(layout: SessionLayout, n_tokens: int) -> int:
    """Raw rows serialized per layer: the live sliding window."""
    return min(layout.raw_window, layout.raw_cap, n_tokens)


def row_counts(cfg: ModelConfig, n_tokens: int) -> tuple[list[int], list[int]]:
    """(n_comp, n_index) per layer after n_tokens: a ratio-m layer has emitted T // m rows."""
    n_comp = [n_tokens // cfg.ratio(il) if cfg.ratio(il) else 0 for il in range(cfg.n_layer)]
    n_index = [n_tokens // cfg.ratio(il) if cfg.layer_kind(il) == CSA else 0
               for il in range(cfg.n_layer)]
    return n_comp, n_index


def layer_sections(cfg: ModelConfig, il: int, raw_rows: int, n_comp: int,
                   n_index: int) -> list[tuple[str, tuple[int, int]]]:
    """The (state name, [rows, width]) float32 blocks of layer il's section, in file order."""
    D, ID = cfg.head_dim, cfg.indexer_head_dim
    parts = [("raw", (raw_rows, D))]
    m = cfg.ratio(il)
    if m:
        c = cfg.compressor_lanes(il)
        parts += [("comp", (n_comp, D)), ("comp_kv", (c * m, c * D)), ("comp_score", (c * m, c * D))]
    if cfg.layer_kind(il) == CSA:
        parts += [("index", (n_index, ID)), ("index_kv", (2 * m, 2 * ID)),
                  ("index_score", (2 * m, 2 * ID))]
    return parts


def payload_bytes(cfg: ModelConfig, n_tokens: int, raw_rows: int | None = None,
                  n_comp=None, n_index=None) -> int:
    """The exact size of a (tail-less) payload; row counts default to those after n_tokens with
    a window of min(sliding_window, T) raw rows."""
    if raw_rows is None:
        raw_rows = min(cfg.sliding_window, n_tokens)
    if n_comp is None or n_index is None:
        n_comp, n_index = row_counts(cfg, n_tokens)
    size = HEADER_BYTES + 4 * n_tokens + 4 * cfg.n_vocab + 8 * cfg.n_layer
    for il in range(cfg.n_layer):
        for _, (r, w) in layer_sections(cfg, il, raw_rows, int(n_comp[il]), int(n_index[il])):
            size += 4 * r * w
    return size


def session_payload_bytes(cfg: ModelConfig, layout: SessionLayout, n_tokens: int) -> int:
    return payload_bytes(cfg, n_tokens, raw_live(layout, n_tokens))


# ---- reading ------------------------------------------------------------------------------------

@dataclass
class Payload:
    """A parsed, validated payload held in host memory."""

    header: Header
    tokens: np.ndarray  # uint32 [T]
    logits: np.ndarray  # float32 [vocab]
    n_comp: np.ndarray  # uint32 [n_layer]
    n_index: np.ndarray  # uint32 [n_layer]
    layers: list[dict[str, np.ndarray]] = field(default_factory=list)  # file-order blocks
    mtp_tail: tuple[int, float, int] | None = None
    nbytes: int = 0
    identity: Identity | None = None


class _Source:
    """Exact reads from a binary stream, bounded by an optional declared size."""

    def __init__(self, f: IO[bytes], limit: int | None):
        self.f, self.limit, self.pos = f, limit, 0
        self.digest = None  # a hashlib object fed every byte read, when set

    def read(self, n: int, what: str) -> bytes:
        if self.limit is not None and self.pos + n > self.limit:
            raise _fail(E_MISSING, f"{what} needs {self.pos + n} bytes, the payload has {self.limit}")
        chunks, got = [], 0
        while got < n:
            b = self.f.read(n - got)
            if not b:
                raise _fail(E_MISSING, f"the data ends after {self.pos + got} bytes, inside {what}")
            chunks.append(b)
            got += len(b)
        self.pos += n
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self.digest is not None:
            self.digest.update(data)
        return data

    def array(self, dtype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        data = self.read(count * 4, what)
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def rest(self, at_most: int) -> bytes:
        """Up to `at_most` more bytes (fewer at the end of the data)."""
        if self.limit is not None:
            at_most = min(at_most, self.limit - self.pos)
        chunks, got = [], 0
        while got < at_most:
            b = self.f.read(at_most - got)
            if not b:
                break
            chunks.append(b)
            got += len(b)
        self.pos += got
        data = b"".join(chunks)
        if self.digest is not None:
            self.digest.update(data)
        return data


@contextlib.contextmanager
def _open_source(src, nbytes: int | None) -> Iterator[_Source]:
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = memoryview(src).cast("B")
        yield _Source(io.BytesIO(data), len(data) if nbytes is None else nbytes)
    elif isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as f:
            yield _Source(f, nbytes)
    else:
        yield _Source(src, nbytes)


def check_header(h: Header, cfg: ModelConfig, layout: SessionLayout | None = None) -> None:
    """ds4's header checks, in ds4's order. Without a layout, the payload is checked against
    itself (as a receiver with a model but no session does)."""
    if h.magic != MAGIC or h.version not in VERSIONS:
        raise _fail(E_VERSION, f"magic {h.magic:#010x}, version {h.version} ({_EXPECTED_VERSION})")
    if h.n_tokens == 0:
        raise _fail(E_EMPTY, "n_tokens is 0 (a session is saved after at least one token)")
    ctx = layout.ctx if layout is not None else min(h.ctx, cfg.context_length)
    if h.ctx > ctx or h.n_tokens >= ctx:
        raise _fail(E_FIT, f"saved ctx {h.ctx} with {h.n_tokens} tokens, current ctx {ctx}")
    if h.dims != model_dims(cfg):
        raise _fail(E_LAYOUT, "(n_layer, head_dim, indexer_head_dim, vocab) = "
                              f"{h.dims}, this model has {model_dims(cfg)}")
    if layout is not None:
        # a window cut short by its session's ctx holds every token: a longer one takes it whole
        cut = h.raw_window == min(cfg.sliding_window, h.ctx) == h.ctx < layout.raw_window
        if h.prefill_cap != layout.prefill_cap or (h.raw_window != layout.raw_window and not cut):
            raise _fail(E_CHUNK, f"saved prefill_cap {h.prefill_cap}, raw_window {h.raw_window}; "
                                 f"current {layout.prefill_cap}, {layout.raw_window}")
    else:
        want = min(cfg.sliding_window, h.ctx)
        if not 1 <= h.prefill_cap <= h.ctx or h.raw_window != want:
            raise _fail(E_CHUNK, f"saved prefill_cap {h.prefill_cap}, raw_window {h.raw_window} "
                                 f"(ctx {h.ctx}, this model's window {want})")
    cur_raw_cap = layout.raw_cap if layout is not None else h.raw_cap
    if (h.raw_cap == 0 or h.raw_live != min(h.n_tokens, h.raw_window) or h.raw_live > h.raw_cap
            or h.raw_live > cur_raw_cap):
        raise _fail(E_RING, f"raw_live {h.raw_live}, {h.n_tokens} tokens, raw_window "
                            f"{h.raw_window}, saved raw_cap {h.raw_cap}, current raw_cap {cur_raw_cap}")
    if layout is not None and h.comp_cap > layout.comp_cap:
        raise _fail(E_COMP_CAP, f"saved comp_cap {h.comp_cap}, current {layout.comp_cap}")


def check_row_counts(h: Header, n_comp, n_index, cfg: ModelConfig,
                     layout: SessionLayout | None = None) -> None:
    """ds4's bounds (saved comp_cap, current per-layer cap), plus ours: a layer of ratio m holds
    exactly T // m rows, since that is what this engine's state is (and what ds4 writes)."""
    ctx = layout.ctx if layout is not None else h.ctx
    want_comp, want_index = row_counts(cfg, h.n_tokens)
    for il in range(cfg.n_layer):
        m = cfg.ratio(il)
        cap = ctx // m + 2 if m else 0
        for got, want, msg in ((int(n_comp[il]), want_comp[il], E_COMP_ROWS),
                               (int(n_index[il]), want_index[il], E_INDEX_ROWS)):
            if got > h.comp_cap or got > cap or got != want:
                raise _fail(msg, f"layer {il} (ratio {m}) has {got} rows, expected {want} after "
                                 f"{h.n_tokens} tokens")


def _read_prefix(s: _Source, cfg: ModelConfig, layout: SessionLayout | None):
    h = Header.unpack(s.read(HEADER_BYTES, "the header"))
    check_header(h, cfg, layout)
    tokens = s.array("<u4", (h.n_tokens,), "the tokens")
    bad = np.nonzero(tokens >= cfg.n_vocab)[0]
    if bad.size:
        raise _fail(E_TOKEN, f"tokens[{bad[0]}] = {tokens[bad[0]]}, vocab {cfg.n_vocab}")
    logits = s.array("<f4", (cfg.n_vocab,), "the logits")
    n_comp = s.array("<u4", (cfg.n_layer,), "the compressed row counts")
    n_index = s.array("<u4", (cfg.n_layer,), "the indexer row counts")
    check_row_counts(h, n_comp, n_index, cfg, layout)
    return h, tokens, logits, n_comp, n_index


def _read_tail(s: _Source, h: Header, model: ModelRef | None = None) -> tuple[int, float, int] | None:
    extra = s.rest(MTP_TAIL_BYTES + 1)
    body = s.pos - len(extra)
    if h.version >= 2 and len(extra) == MTP_TAIL_BYTES:
        # a file of this model cut MTP_TAIL_BYTES into its identity trailer ends as a tail would
        if model is not None and extra == trailer_start(model, MTP_TAIL_BYTES):
            raise _fail(E_TRAILING, f"{MTP_TAIL_BYTES} bytes after the {body}-byte payload are the start of the "
                                    f"identity trailer of {model.describe()}, not an MTP tail: the file was "
                                    f"cut short inside its identity trailer")
        tail = MTP_TAIL.unpack(extra)
        if not math.isfinite(tail[1]):  # an average of acceptances is a finite number
            raise _fail(E_TRAILING, f"{MTP_TAIL_BYTES} bytes after the {body}-byte payload are no MTP tail: "
                                    f"mtp_accept_ewma = {tail[1]!r}, expected a finite number")
        return tail
    if extra:
        more = "more" if len(extra) > MTP_TAIL_BYTES else str(len(extra))
        # a file cut inside its identity trailer has no trailer to find: its rest reads as this
        raise _fail(E_TRAILING, f"{more} bytes after the {body}-byte payload (or the file was cut short "
                                f"inside its identity trailer)")
    return None


def read_payload(src, cfg: ModelConfig, layout: SessionLayout | None = None,
                 nbytes: int | None = None, model: ModelRef | None = None) -> Payload:
    """Parse and validate a whole payload (bytes, a path or a binary stream) into host arrays.

    `layout` is the session it is meant for (None: check it against itself only); `nbytes` the
    size the caller says it has (None: the data runs to the end of the bytes/file/stream);
    `model` the model it must come from when its identity trailer names one. A trailer's
    checksum is verified over the whole body (a stream must be seekable to carry a trailer)."""
    ident = read_identity(src, nbytes)
    check_model(ident, model)
    with _open_source(src, ident.body_bytes if ident else nbytes) as s:
        if ident is not None:
            s.digest = hashlib.sha256()
        h, tokens, logits, n_comp, n_index = _read_prefix(s, cfg, layout)
        layers = []
        for il in range(cfg.n_layer):
            blocks = {}
            for name, shape in layer_sections(cfg, il, h.raw_live, int(n_comp[il]), int(n_index[il])):
                blocks[name] = s.array("<f4", shape, f"layer {il} {name}")
            layers.append(blocks)
        tail = _read_tail(s, h, model)
        size = s.pos
        if ident is not None:
            _check_digest(s.digest.digest(), ident)
            s.limit = None
            s.digest = None
            s.read(ident.trailer_bytes, "the identity trailer")  # leave a stream after it
            size += ident.trailer_bytes
        return Payload(h, tokens, logits, n_comp, n_index, layers, tail, size, ident)


def check_payload(src, cfg: ModelConfig | None = None, nbytes: int | None = None,
                  model: ModelRef | None = None) -> Header:
    """The cheap check a receiver makes: the header (and, given the model, every count, the
    exact size and the identity trailer's model) without reading the tensor data."""
    if cfg is not None:
        ident = read_identity(src, nbytes)
        check_model(ident, model)
        if ident is not None:
            nbytes = ident.body_bytes
    with _open_source(src, nbytes) as s:
        if cfg is None:
            h = Header.unpack(s.read(HEADER_BYTES, "the header"))
            if h.magic != MAGIC or h.version not in VERSIONS:
                raise _fail(E_VERSION, f"magic {h.magic:#010x}, version {h.version} ({_EXPECTED_VERSION})")
            return h
        h, _, _, n_comp, n_index = _read_prefix(s, cfg, None)
        want = payload_bytes(cfg, h.n_tokens, h.raw_live, n_comp, n_index)
        if nbytes is None and isinstance(src, (str, os.PathLike)):
            nbytes = os.path.getsize(src)
        if nbytes is not None:
            tail = MTP_TAIL_BYTES if h.version >= 2 and nbytes == want + MTP_TAIL_BYTES else 0
            if nbytes < want:
                raise _fail(E_MISSING, f"the payload has {nbytes} bytes, its header says {want}")
            if nbytes > want + tail:
                raise _fail(E_TRAILING, f"the payload has {nbytes} bytes, its header says {want}")
        return h


# ---- sessions -----------------------------------------------------------------------------------

def _check_whole_model(session) -> None:
    eng = session.engine
    if len(session.states) != eng.config.n_layer:
        raise PayloadError(f"a DSV4 payload holds every layer; this session holds layers "
                           f"{eng.layers.start}:{eng.layers.stop} of {eng.config.n_layer}")


class _HashingWriter:
    """Forwards writes to a stream and feeds them to a SHA-256."""

    def __init__(self, f: IO[bytes]):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, b: bytes) -> int:
        self.digest.update(b)
        return self.f.write(b)


def write_session(session, f: IO[bytes], version: int = VERSION, identity: bool = True) -> int:
    """Write the session's payload to a binary stream; returns the bytes written. With
    `identity`, the model's fingerprint and the body's SHA-256 follow in the identity trailer
    (without it: the bare body upstream ds4 writes)."""
    if version not in VERSIONS:
        raise ValueError(f"version: expected 1 or 2, got {version}")
    _check_whole_model(session)
    cfg, layout, be = session.engine.config, session.layout, session.engine.backend
    tokens = session.tokens
    if not tokens:
        raise PayloadError("the session holds no tokens yet: nothing to save")
    T = len(tokens)
    model = ModelRef.of(getattr(session.engine, "model", None)) if identity else None
    if model is not None:
        f = _HashingWriter(f)
    h = Header.for_session(cfg, layout, T, version)
    n_comp, n_index = row_counts(cfg, T)
    f.write(h.pack())
    f.write(np.asarray(tokens, dtype="<u4").tobytes())
    f.write(np.asarray(session.logits, dtype="<f4").tobytes())
    f.write(np.asarray(n_comp, dtype="<u4").tobytes())
    f.write(np.asarray(n_index, dtype="<u4").tobytes())
    written = HEADER_BYTES + 4 * T + 4 * cfg.n_vocab + 8 * cfg.n_layer
    logical = np.arange(T - h.raw_live, T) % layout.raw_cap  # ring rows, oldest first
    for il in range(cfg.n_layer):
        st = session.states[il]
        for name, (rows, _) in layer_sections(cfg, il, h.raw_live, n_comp[il], n_index[il]):
            a = np.asarray(be.state_to_numpy(st, name))
            if name == "raw":
                a = a[logical]
            elif name in ("comp", "index"):
                a = a[:rows]
            b = np.ascontiguousarray(a, dtype="<f4").tobytes()
            f.write(b)
            written += len(b)
    if model is not None:
        trailer = Identity(model, f.digest.digest(), written).pack()
        f.f.write(trailer)
        written += len(trailer)
    return written


def save_session(session, dest, version: int = VERSION, identity: bool = True) -> int:
    """`Session.save_payload`: to a binary stream, or atomically to a path."""
    if isinstance(dest, (str, os.PathLike)):
        with atomic_file(dest) as f:
            return write_session(session, f, version, identity)
    return write_session(session, dest, version, identity)


def host_state(p: Payload, cfg: ModelConfig, layout: SessionLayout, il: int) -> dict[str, np.ndarray]:
    """Layer il's full state arrays (session layout) rebuilt from a payload: raw rows back into
    the ring at pos % raw_cap, compressed rows from row 0, frontiers whole, the rest as a fresh
    session has them."""
    out = host_layer_state(cfg, layout, il)
    T = p.header.n_tokens
    for name, block in p.layers[il].items():
        if name == "raw":
            out["raw"][np.arange(T - block.shape[0], T) % layout.raw_cap] = block
        elif name in ("comp", "index"):
            out[name][: block.shape[0]] = block
        else:
            out[name][...] = block
    return out


def load_session(session, src, nbytes: int | None = None) -> tuple[list[int], np.ndarray]:
    """`Session.load_payload`: validate the whole payload, then write the session's state arrays.
    Returns (tokens, logits) for the session to adopt. Validation failures raise PayloadError
    before the session is touched."""
    _check_whole_model(session)
    cfg, layout, be = session.engine.config, session.layout, session.engine.backend
    p = read_payload(src, cfg, layout, nbytes, ModelRef.of(getattr(session.engine, "model", None)))
    try:
        for il, st in session.states.items():
            layer_from_host(be, st, host_state(p, cfg, layout, il))
    except BaseException:
        session.sync([])  # never leave a half-written state behind
        raise
    return [int(t) for t in p.tokens], np.array(p.logits, dtype=np.float32)
