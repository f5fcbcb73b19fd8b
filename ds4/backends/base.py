"""The op interface every backend implements; `ds4/core/graph.py` is written against it.

Ops are kernel-sized (the Triton backend's kernel list), take and return backend arrays, and
never hand data back to the host inside a forward step: routing, indexer selection, positions
and row counts stay where the backend keeps them. Shapes below use n = tokens in the chunk,
E = n_embd, HC = n_hc, H = heads, D = head_dim. A chunk covers absolute positions [p0, p0 + n).

`numerics` is "ds4" (apply the FP8 / Hadamard+FP4 / f16 simulations of spec §3.10 where the ops
below say so) or "exact" (leave them out).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from ..core.config import ModelConfig
from ..core.gguf_model import Tensor
from ..core.weights import Compressor, HyperConnection, Indexer

Array = Any  # the backend's array type
LayerState = dict  # name -> Array, shapes from ds4.core.state.layer_state_shapes


class Backend(ABC):
    name: str = "?"
    # A prompt's chunks gathered so that their FFN sublayers run once over up to this many rows
    # (graph.forward_chunks); 0: each chunk runs alone (forward_chunk)
    prefill_ffn_rows: int = 0
    # the fewest tokens a chunk needs to join such a group (a backend whose FFN kernels for fewer
    # rows compute otherwise sets its threshold, so a group keeps each chunk's arithmetic)
    prefill_ffn_min_rows: int = 1

    def __init__(self, cfg: ModelConfig, numerics: str = "ds4"):
        if numerics not in ("ds4", "exact"):
            raise ValueError(f"numerics: expected 'ds4' or 'exact', got {numerics!r}")
        self.cfg = cfg
        self.numerics = numerics

    @property
    def ds4_numerics(self) -> bool:
        return self.numerics == "ds4"

    @property
    def device(self) -> str:
        return "cpu"

    # ---- memory ---------------------------------------------------------------------------------

    @abstractmethod
    def upload(self, tensor: Tensor) -> Any:
        """Make a weight usable by the ops; must keep quantized weights quantized."""

    @abstractmethod
    def alloc_state(self, shapes: dict[str, tuple[int, ...]], fill: dict[str, float]) -> LayerState: ...

    @abstractmethod
    def state_to_numpy(self, st: LayerState, name: str) -> np.ndarray: ...

    @abstractmethod
    def state_from_numpy(self, st: LayerState, name: str, value: np.ndarray) -> None: ...

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray: ...

    @abstractmethod
    def from_numpy(self, x: np.ndarray) -> Array:
        """A host float32 array as this backend's array (a pipeline stage's incoming rows)."""

    # ---- decode steps chained on the device (optional) -----------------------------------------

    def chains(self, states: dict, params) -> bool:
        """Whether decode steps of the session holding `states` can run back to back, each one
        choosing the next token itself with these SamplingParams, so that the host queues a step
        before it has seen the token that step evaluates (Session.sample). False unless a backend
        can."""
        return False

    def chain_launch(self, states: dict, p0: int, token: int | None = None,
                     draw: tuple[float, float, float] | None = None) -> Any:
        """Queue the decode step at position p0 of `states`: it evaluates `token`, or when None
        the token the previous launch chose, and chooses the next one: the argmax, or with
        `draw` = (T, min_p, U) ds4's default sampling path with that uniform. Returns a ticket
        for chain_token. Only where `chains` said so."""
        raise NotImplementedError(f"the {self.name} backend does not chain decode steps")

    def chain_token(self, ticket: Any) -> int:
        """The token the step of `ticket` chose, once it has run (waits for it)."""
        raise NotImplementedError(f"the {self.name} backend does not chain decode steps")

    def chain_logits(self, states: dict) -> np.ndarray:
        """The logits of the last step chain_launch queued for `states`, once it has run."""
        raise NotImplementedError(f"the {self.name} backend does not chain decode steps")

    # ---- ops ------------------------------------------------------------------------------------

    def branch(self):
        """A context around ops whose results the ops right after it do not need (graph.py: the
        KV path beside the query path, the shared expert beside the routing). A backend may run
        them concurrently with what follows, honouring every data dependency itself; by default
        they simply run in order."""
        return contextlib.nullcontext()

    def begin_chunk(self, states: dict, tokens: np.ndarray, p0: int, logits: bool) -> None:
        """Called by forward_chunk before a chunk's first op (by forward_chunks once for a group,
        with all its tokens and its first position). A backend that replays whole decode steps
        (CUDA graphs) learns here which session (`states`) and position a step is for."""

    @abstractmethod
    def embed(self, token_embd, tokens: np.ndarray) -> Array:
        """[n] token ids -> mHC state [n, HC, E], each stream a copy of the embedding row."""

    @abstractmethod
    def hc_pre(self, X: Array, hc: HyperConnection) -> tuple[Array, Array, Array]:
        """mHC collapse (§3.2): -> (x_in [n, E], post [n, HC], comb [n, HC, HC])."""

    @abstractmethod
    def hc_post(self, y: Array, X: Array, post: Array, comb: Array) -> Array:
        """mHC expand (§3.3): X_new[j] = post[j]·y + Σ_i comb[i][j]·X[i]."""

    @abstractmethod
    def rms_norm(self, x: Array, weight=None) -> Array:
        """RMSNorm over the last axis (eps from the config); weight None = unweighted."""

    @abstractmethod
    def linear(self, x: Array, w) -> Array:
        """[n, in] @ W[out, in]ᵀ -> [n, out] on the quantized weight."""

    @abstractmethod
    def rope(self, x: Array, p0: int, il: int, inverse: bool = False) -> Array:
        """Tail RoPE (adjacent pairs, last n_rot dims) of [n, ..., d] rows at positions p0+i,
        with layer il's frequencies; inverse rotates back (sin negated)."""

    @abstractmethod
    def kv_store(self, st: LayerState, kv: Array, p0: int) -> None:
        """FP8 simulation (ds4) and f16 rounding (ds4) of the [n, D] K=V rows, pushed into the
        raw ring at p % raw_cap."""

    @abstractmethod
    def compressor(self, st: LayerState, a: Array, w: Compressor, p0: int, il: int, indexer: bool) -> None:
        """Feed n attention-normed activations to the layer's compressor (§3.5), appending a
        compressed row (attention: FP8 + f16 in ds4 numerics; indexer: Hadamard+FP4 + f16)
        whenever a window closes. Rows go to st['comp'] / st['index']."""

    @abstractmethod
    def indexer_select(self, st: LayerState, qr: Array, a: Array, w: Indexer, p0: int, il: int) -> Array | None:
        """CSA top-k (§3.6): a visibility mask [n, rows] over compressed rows, or None when no
        query in the chunk sees more rows than top_k."""

    @abstractmethod
    def attention(self, q: Array, st: LayerState, sinks, p0: int, il: int, selected: Array | None) -> Array:
        """Sink attention (§3.4 step 9) of q [n, H, D] over the raw window and the visible
        compressed rows (filtered by `selected`) -> [n, H, D]."""

    @abstractmethod
    def grouped_output(self, o: Array, w_a, w_b) -> Array:
        """[n, H, D] -> [n, E] through the grouped low-rank output projection (§3.4 step 11)."""

    @abstractmethod
    def router(self, f: Array, gate_inp, bias, tid2eid, tokens: np.ndarray, il: int) -> tuple[Array, Array]:
        """-> (expert ids [n, k], weights [n, k]) per §3.7 (hash layers use tid2eid[token])."""

    @abstractmethod
    def moe(self, f: Array, ids: Array, weights: Array, gate, up, down, il: int) -> Array:
        """Σ_i w_i · down_e(swiglu(gate_e·f, up_e·f)) over the selected experts -> [n, E]."""

    def ids_from_numpy(self, ids: np.ndarray) -> Array:
        """Host expert ids [n, k] as the ids `router` returns (a canonical tensor-parallel
        pair's worker adopts the leader's routing, wire.md §2)."""
        raise NotImplementedError(f"{self.name}: ids_from_numpy")

    @abstractmethod
    def expert_part(self, ids: Array, weights: Array, first: int, count: int) -> tuple[Array, Array]:
        """A tensor-parallel rank's view of the routing (wire.md §2): it holds experts
        [first, first + count) as local 0..count-1. -> (local ids, weights): a slot routed to
        another rank's expert gets local id 0 and weight exactly 0, so `moe` adds an exact zero
        for it and the slots keep their order."""

    @abstractmethod
    def shared_expert(self, f: Array, gate, up, down, il: int) -> Array: ...

    @abstractmethod
    def add(self, a: Array, b: Array) -> Array: ...

    def rows(self, X: Array, a: int, b: int) -> Array:
        """Rows [a, b) of X (graph.forward_chunks: one chunk of a group)."""
        return X[a:b]

    @abstractmethod
    def concat_rows(self, parts: list) -> Array:
        """The arrays `parts` one after another along their first axis (graph.forward_chunks: the
        group's chunks before their FFN sublayer, whose hc_pre comes next; a backend whose mHC
        collapse sums rows otherwise in bulk than alone collapses them chunk by chunk there)."""

    @abstractmethod
    def head_norm(self, q: Array) -> Array:
        """[n, H*D] -> per-head unweighted RMSNorm, shaped [n, H, D]."""

    @abstractmethod
    def output_logits(self, X: Array, hc: HyperConnection, norm, out) -> Array:
        """Output head (§3.8) of the last row of X [n, HC, E] -> float32 logits [vocab]."""

    def output_argmax(self, X: Array, hc: HyperConnection, norm, out) -> np.ndarray:
        """Greedy id after every row of X (first index of the maximum), [n] int64.

        The last pipeline stage answers a prefill frame with one id per position. This default
        runs the head row by row; a backend overrides it to read the head's weights once."""
        ids = np.empty(X.shape[0], dtype=np.int64)
        for i in range(X.shape[0]):
            ids[i] = int(np.argmax(self.to_numpy(self.output_logits(X[i:i + 1], hc, norm, out))))
        return ids
