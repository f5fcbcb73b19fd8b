"""`Engine` (a mapped model bound to a backend) and `Session` (one sequence's state).

    eng = ds4.Engine.open("model.gguf", backend="reference")
    s = eng.session(ctx=4096)
    s.sync(eng.tokenizer.encode_rendered(prompt))
    s.eval(token); s.logits  # float32 [vocab], for the next token
    for token in s.sample(64, SamplingParams(), Rng(seed), stop={eng.tokenizer.eos_id}): ...
"""

from __future__ import annotations

import os
from collections.abc import Container, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .backends import backend_class
from .core.gguf_model import GGUFModel
from .core.graph import Partner, chunk_bounds, chunk_groups, forward_chunk, forward_chunks
from .core.sampling import GREEDY, Rng, SamplingParams, sample, unsorted_path
from .core.state import SessionLayout, alloc_states, states_from_host, states_to_host
from .core.tokenizer import Tokenizer
from .core.tp_split import RankPart
from .core.weights import bind_weights


class Engine:
    def __init__(self, model: GGUFModel, backend, weights, layers: range, part: RankPart | None = None):
        self.model = model
        self.config = model.config
        self.backend = backend
        self.weights = weights
        self.layers = layers
        self.part = part  # a tensor-parallel rank's share of the model (None: all of it)
        self.partner: Partner | None = None  # its link to the other ranks (ds4/tp sets it)

    @classmethod
    def open(cls, path: str | os.PathLike | None = None, backend: str = "reference",
             numerics: str = "ds4", layers: range | None = None, part: RankPart | None = None,
             **backend_options) -> "Engine":
        """Map the GGUF (None = the embedded default model) and bind it to a backend.

        `layers` (default: all) binds only a contiguous layer range, as a pipeline stage does:
        the embedding is bound when the range starts at 0, the output head when it ends at the
        last layer. `part` binds a tensor-parallel rank's share (ds4/core/tp_split.py); its
        sessions need `partner` set before they run (ds4/tp does both).
        """
        if path is None:
            from .core.default_model import default_model_path

            path = default_model_path()
        model = GGUFModel(path)
        if numerics == "ds4":
            model.config.check_ds4_numerics()
        n_layer = model.config.n_layer
        layers = range(n_layer) if layers is None else layers
        if layers.step != 1 or not 0 <= layers.start < layers.stop <= n_layer:
            raise ValueError(f"layers: expected a contiguous range within [0, {n_layer}), got "
                             f"{layers.start}:{layers.stop}")
        if part is not None and layers != range(n_layer):
            raise ValueError("layers: a tensor-parallel rank runs every layer")
        cfg = model.config if part is None else part.config(model.config)
        be = backend_class(backend)(cfg, numerics=numerics, **backend_options)
        weights = bind_weights(model, be.upload, layers=layers, embedding=layers.start == 0,
                               head=layers.stop == n_layer, part=part)
        return cls(model, be, weights, layers, part)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_vocabulary(*self.model.vocabulary)

    @property
    def numerics(self) -> str:
        return self.backend.numerics

    def session(self, ctx: int = 4096, prefill_cap: int | None = None) -> "Session":
        return Session(self, SessionLayout.create(self.config, ctx, prefill_cap))


class EngineFront:
    """What a multi-node engine (a pipeline head, a tensor-parallel leader) shows of the local
    Engine it drives, `self.engine`: its model, config, backend, numerics and tokenizer."""

    engine: Engine

    @property
    def model(self):
        return self.engine.model

    @property
    def config(self):
        return self.engine.config

    @property
    def backend(self):
        return self.engine.backend

    @property
    def numerics(self) -> str:
        return self.engine.numerics

    @property
    def tokenizer(self):
        return self.engine.tokenizer


def check_tokens(tokens, n_vocab: int, ctx: int) -> list[int]:
    """Token ids as ints, each checked against the vocabulary, all of them against the ctx."""
    tokens = [int(t) for t in tokens]
    for i, t in enumerate(tokens):
        if not 0 <= t < n_vocab:
            raise ValueError(f"tokens[{i}]: expected an id in [0, {n_vocab}), got {t}")
    if len(tokens) > ctx:
        raise ValueError(f"tokens: {len(tokens)} tokens do not fit the session's ctx={ctx}")
    return tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Snapshot:
    tokens: list[int]
    logits: np.ndarray | None
    arrays: dict  # layer -> state name -> numpy array
    layout: SessionLayout

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for st in self.arrays.values() for a in st.values())


class Session:
    """The state of one token sequence: per-layer caches plus the next-token logits."""

    def __init__(self, engine: Engine, layout: SessionLayout):
        self.engine = engine
        self.layout = layout
        self.ctx = layout.ctx
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        be, cfg = self.engine.backend, self.engine.config
        self.states = alloc_states(be, cfg, self.layout, self.engine.weights.layers)
        self._tokens = []
        self._logits = None

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            raise RuntimeError("session has no logits yet: sync or eval at least one token")
        return self._logits

    def _check_tokens(self, tokens) -> list[int]:
        return check_tokens(tokens, self.engine.config.n_vocab, self.ctx)

    def _prefill(self, new: list[int]) -> None:
        """Evaluate `new` after the current tokens, in chunks aligned to prefill_cap (several at
        a time where the backend runs their FFN sublayers together: prefill_ffn_rows)."""
        be, w = self.engine.backend, self.engine.weights
        if w.token_embd is None or w.output is None:
            raise RuntimeError(f"this engine holds layers {self.engine.layers.start}:"
                               f"{self.engine.layers.stop} only; run it as a pipeline stage")
        start = len(self._tokens)
        end = start + len(new)
        # (slices of `new` only: `tokens + new` copied the whole history twice a decode step, part
        # of 0.34 ms of host time before the step's launch at 32768 tokens, 0.11 without)
        tp = self.engine.partner
        bounds = chunk_bounds(start, end, self.layout.prefill_cap)
        for group in chunk_groups(bounds, be.prefill_ffn_rows if tp is None else 0, be.prefill_ffn_min_rows):
            a, b = group[0][0], group[-1][1]
            part = new[a - start:b - start]
            ids = np.asarray(part, dtype=np.int64)
            if len(group) == 1:
                out = forward_chunk(be, w, self.states, ids, a, logits=(b == end), tp=tp)
            else:
                out = forward_chunks(be, w, self.states, ids, group, logits=(b == end))
            self._tokens.extend(part)  # (the session's own list: tokens / snapshot hand out copies)
        self._logits = np.asarray(be.to_numpy(out), dtype=np.float32)

    def sync(self, tokens) -> None:
        """Make the session hold exactly `tokens`, reusing the common prefix it already has."""
        tokens = self._check_tokens(tokens)
        if not tokens:
            self._reset_state()
            return
        common = common_prefix(self._tokens, tokens)
        if common == len(tokens) == len(self._tokens):
            return
        if common < len(self._tokens) or common == len(tokens):
            # The compressor frontiers and the raw ring cannot be un-run: rebuild from the start.
            self._reset_state()
            common = 0
        self._prefill(tokens[common:])

    def eval(self, token: int) -> None:
        """Append one token (a decode step)."""
        if len(self._tokens) + 1 > self.ctx:
            raise ValueError(f"eval: the session is full (ctx={self.ctx})")
        self._prefill(self._check_tokens([token]))

    def greedy(self, n: int, stop: Container[int] = ()) -> Iterator[int]:
        """`sample` with greedy parameters: eval(argmax) in a loop."""
        return self.sample(n, GREEDY, None, stop)

    def sample(self, n: int, params: SamplingParams = GREEDY, rng: Rng | None = None,
               stop: Container[int] = ()) -> Iterator[int]:
        """Up to n tokens after the current ones, each drawn from the logits with `params` and
        `rng` (ds4's sampler, core/sampling.py; greedy needs no rng), yielded as they are chosen
        and each evaluated, so that the session holds it afterwards. The run ends after a token
        in `stop`, which is evaluated too, or when the context is full. Iterate it to the end or
        close it before using the session again.

        Where the backend chooses tokens on the device with these parameters (`chains`), steps
        run back to back: the step that evaluates a token is queued before the host has seen
        that token, so the host's work between steps hides behind the device's. That is why a
        stop token is evaluated: its step is under way by the time the host reads it. The
        tokens, the state, the final logits and rng's state are those of sample + eval in a
        loop (stop token included); a device's sampler may add its own float64 rounding (a draw
        within ~1e-15 of a boundary between two tokens)."""
        if float(np.float32(params.temperature)) > 0.0 and rng is None:
            raise ValueError("sample: a temperature above 0 needs an rng (ds4.core.sampling.Rng)")
        n = min(int(n), self.ctx - len(self._tokens))
        be = self.engine.backend
        while n > 0:
            token = sample(self.logits, params, rng)
            if be.chains(self.states, params):
                yield from self._sample_on_device(token, n, params, rng, stop)
                return
            self.eval(token)  # the first steps of a session: the backend prepares its step here
            n -= 1
            yield token
            if token in stop:
                return

    def _sample_on_device(self, token: int, n: int, params: SamplingParams, rng: Rng | None,
                          stop: Container[int]) -> Iterator[int]:
        be = self.engine.backend
        temperature, min_p = unsorted_path(params)  # (the backend `chains` these parameters)
        unused = None  # rng's state before the last launch's draw, which no yielded token used

        def launch(pos, token=None):
            nonlocal unused
            draw = None
            if temperature > 0.0:
                unused = rng.state
                draw = (temperature, min_p, rng.uniform())
            return be.chain_launch(self.states, pos, token, draw)

        p0 = len(self._tokens)
        ticket = launch(p0, token)
        self._tokens.append(token)
        self._logits = None
        try:
            yield token
            while token not in stop and len(self._tokens) - p0 < n:
                # the next step goes in before the host knows its token: the one `ticket` chose
                queued = launch(len(self._tokens))
                try:
                    token = be.chain_token(ticket)
                except ValueError:
                    self._reset_state()  # a step of no valid token is under way: no state to keep
                    raise
                except BaseException:  # interrupted while waiting: the queued step still runs
                    self._tokens.append(be.chain_token(ticket))
                    raise
                ticket = queued
                self._tokens.append(token)
                yield token
        finally:
            if unused is not None:
                rng.state = unused
            if self._tokens:
                self._logits = np.asarray(be.chain_logits(self.states), dtype=np.float32)

    def snapshot(self) -> "Snapshot":
        """A host copy of the whole session (state arrays, tokens, logits) to restore later."""
        be = self.engine.backend
        arrays = states_to_host(be, self.states)
        logits = None if self._logits is None else self._logits.copy()
        return Snapshot(list(self._tokens), logits, arrays, self.layout)

    def restore(self, snap: "Snapshot") -> None:
        if snap.layout != self.layout:
            raise ValueError(f"snapshot: expected a session layout {self.layout}, got {snap.layout}")
        states_from_host(self.engine.backend, self.states, snap.arrays)
        self._tokens = list(snap.tokens)
        self._logits = None if snap.logits is None else snap.logits.copy()

    def rewind(self, pos: int) -> None:
        """Keep only the first `pos` tokens."""
        if not 0 <= pos <= len(self._tokens):
            raise ValueError(f"rewind: expected a position in [0, {len(self._tokens)}], got {pos}")
        if pos != len(self._tokens):
            self.sync(self._tokens[:pos])

    def save_payload(self, dest, version: int = 2, identity: bool = True) -> int:
        """Write the DSV4 session payload (spec §4.1) to a binary stream, or atomically to a
        path; returns its size in bytes. `identity`: end it with the model's fingerprint and a
        SHA-256 of the body (ds4/core/payload_identity.py), which loading checks; False writes the bare
        body that upstream ds4 reads."""
        from .core.payload import save_session

        return save_session(self, dest, version, identity)

    def load_payload(self, src, nbytes: int | None = None) -> None:
        """Restore the session from a DSV4 payload (bytes, a path or a binary stream; `nbytes`:
        its exact size when the stream runs on). The next token is sampled from the saved logits,
        without evaluating the model. Raises PayloadError, leaving the session as it was."""
        from .core.payload import load_session

        self._tokens, self._logits = load_session(self, src, nbytes)
