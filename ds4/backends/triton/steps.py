"""Decode steps of the Triton backend: side streams, CUDA-graph capture and replay of a one-token
chunk, and the steps chained on the device (the next token chosen by the GPU)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from ...core.sampling import unsorted_path
from . import kernels as K
from .lanes import Lanes
from .plumbing import _GraphEntry, _Step, _cdiv, _pow2


class _DecodeSteps:
    """The decode-step machinery of TritonBackend (a mixin: it uses the state TritonBackend.__init__ sets up)."""

    # ---- decode-step machinery ------------------------------------------------------------------

    def _tickets(self) -> torch.Tensor:
        """The split-K tickets of the stream the next launch goes to."""
        ln = self._lanes
        return ln.tickets() if ln is not None and ln.active else self._split_cnt

    @contextlib.contextmanager
    def branch(self):
        ln = self._lanes
        if ln is None or not ln.active:
            yield
            return
        prev = ln.lane
        ln.lane = ln.take()
        try:
            yield
        finally:
            ln.lane = prev

    def _begin_lanes(self, states) -> None:
        """Side streams for the step about to run eagerly or be captured (lanes.py)."""
        if self.lanes <= 0:
            return
        if self._lanes is None or self._lanes.n_side != self.lanes:
            self._lanes = Lanes(self.lanes, self.dev, self._split_cnt.numel())
        ln = self._lanes
        ln.begin(torch.cuda.current_stream(self.dev), self._split_cnt)
        for st in states.values():
            for t in st.values():
                if isinstance(t, torch.Tensor):
                    ln.state(t)

    def _hold_main(self) -> None:
        """In a decode step with side streams: the main stream's next launches (the query's
        32768-row product) wait for this branch's last launch (Lanes.hold_main)."""
        if self._lanes is not None and self._lanes.active:
            self._lanes.hold_main()

    def _follow_main(self) -> None:
        """In a decode step with side streams: this branch's next launches wait for the main
        stream's work so far (Lanes.follow_main), such as a buffer torch just filled there."""
        if self._lanes is not None and self._lanes.active:
            self._lanes.follow_main()

    def _end_lanes(self) -> None:
        if self._lanes is not None:
            self._lanes.end()

    def begin_chunk(self, states, tokens, p0, logits) -> None:
        self._chunk = (states, int(p0), bool(logits))
        self._hl_kept = None

    def _maybe_begin_step(self, tokens) -> None:
        if self._step is not None:
            self._abort_step()
        chunk = self._chunk
        if not self.cuda_graphs or len(tokens) != 1 or chunk is None:
            return
        states, p0, logits = chunk
        if not logits:
            return
        key = id(states)
        e = self._graphs.get(key)
        if e is not None and e.states is not states:
            e = None
        if e is not None and e.failed:
            return
        self._tok1.fill_(int(np.asarray(tokens).reshape(-1)[0]))
        self._set_pos(p0)
        if e is None:
            e = _GraphEntry(states)
            self._graphs[key] = e
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
            self._step = _Step(e, "warm")
            self._begin_lanes(states)
            return
        self._graphs.move_to_end(key)
        if e.graph is None:
            self._step = _Step(e, "capture")
            e.outputs, e.names = [], []
            torch.cuda.synchronize(self.dev)
            e.graph = torch.cuda.CUDAGraph()
            self._cap_stream = torch.cuda.Stream(self.dev)
            self._cap_stream.wait_stream(torch.cuda.current_stream(self.dev))
            self._cap_ctx = torch.cuda.stream(self._cap_stream)
            self._cap_ctx.__enter__()
            e.graph.capture_begin()
            self._begin_lanes(states)
            return
        self._step = _Step(e, "replay")
        e.graph.replay()
        self._pos_host = p0 + 1  # (the step's last kernels, _next_token, advanced it)

    def _end_step(self) -> None:
        st = self._step
        self._step = None
        self._end_lanes()
        if st.phase == "capture":
            st.entry.graph.capture_end()
            self._cap_ctx.__exit__(None, None, None)
            torch.cuda.current_stream(self.dev).wait_stream(self._cap_stream)
            self._cap_ctx = None
            st.entry.graph.replay()
        self._pos_host += 1  # (the step's last kernels, _next_token, advanced it)

    def _abort_step(self) -> None:
        st = self._step
        self._step = None
        if st is None:
            return
        self._pos_host = None  # whether the step's last kernel ran is unknown: set it again
        try:
            self._end_lanes()
        except Exception:
            pass
        if st.phase == "capture" and self._cap_ctx is not None:
            try:
                st.entry.graph.capture_end()
            except Exception:
                pass
            self._cap_ctx.__exit__(None, None, None)
            self._cap_ctx = None
            st.entry.graph = None
            st.entry.failed = True
        elif st.phase == "warm":
            self._graphs.pop(id(st.entry.states), None)

    # ---- decode steps chained on the device ----------------------------------------------------

    _CHAIN_SLOTS = 4  # the host's rings of tokens and draws; Session.sample has two steps in flight

    def _next_token(self, logits) -> None:
        """The last kernels of a decode step: the argmax (greedy_next_kernel), then a draw on ds4's
        default sampling path where the host asked for one (sample_next_kernel). They write the
        token where the step's next replay reads it and into the host's ring, and advance the
        device's position. Replays then chain on the device (Session.sample) and the host's work
        between steps (the launch, Python) overlaps the GPU's instead of adding to it."""
        # after every launch of the step: kernels still running on side streams (the last layer's
        # compressors) read the position this kernel advances
        self._end_lanes()
        V = logits.numel()
        G = _pow2(_cdiv(V, self.chain_block))  # 64 programs for DS4's 129280 logits
        if self._chain_best is None or self._chain_best.numel() < G:
            self._chain_best = torch.zeros(G, dtype=torch.float32, device=self.dev)
            self._chain_at = torch.zeros(G, dtype=torch.int32, device=self.dev)
            self._chain_mass = torch.zeros(G, dtype=torch.float64, device=self.dev)
            self._chain_cnt = torch.zeros(1, dtype=torch.int32, device=self.dev)
            self._chain_top = torch.zeros(1, dtype=torch.float32, device=self.dev)
        R = self._CHAIN_SLOTS
        self._launch(K.greedy_next_kernel, (G,), logits, V, self._chain_best, self._chain_at,
                     self._chain_cnt, self._chain_top, self._tok1, self._pos, self._chain_tokens,
                     R=R, BLOCK=self.chain_block, G=G, num_warps=4, nbytes=4 * V)
        self._launch(K.sample_next_kernel, (G,), logits, V, self._chain_mass, self._chain_cnt,
                     self._chain_top, self._tok1, self._pos, self._chain_tokens, self._chain_draws,
                     R=R, BLOCK=self.chain_block, G=G, num_warps=4)

    def chains(self, states, params) -> bool:
        e = self._graphs.get(id(states))
        if e is None or e.states is not states or e.graph is None or e.failed or self._step is not None:
            return False
        return unsorted_path(params) is not None  # (the two paths _next_token's kernels take)

    def chain_launch(self, states, p0, token=None, draw=None):
        p0 = int(p0)
        key = id(states)
        e = self._graphs[key]
        self._graphs.move_to_end(key)
        if token is not None:
            self._tok1.fill_(int(token))
            self._set_pos(p0)
        elif p0 != self._pos_host:
            raise RuntimeError(f"chain_launch: the device's position is {self._pos_host}, expected {p0}")
        slot = p0 % self._CHAIN_SLOTS
        if draw is not None:  # (the host's slot is free again: its step, 4 back, has run)
            self._chain_draws_np[slot] = draw
            self._chain_draws[3 * slot:3 * slot + 3].copy_(self._chain_draws_host[3 * slot:3 * slot + 3],
                                                            non_blocking=True)
        e.graph.replay()
        self._pos_host = p0 + 1  # (the step's last kernels advanced it)
        self._chain_done[slot].record()
        return p0

    def chain_token(self, ticket) -> int:
        slot = ticket % self._CHAIN_SLOTS
        self._chain_done[slot].synchronize()
        t = int(self._chain_tokens[slot])
        if t < 0:
            raise ValueError(f"cannot choose a token: none of the {self.cfg.n_vocab} logits is "
                             "finite (all -inf or NaN)")
        return t

    def chain_logits(self, states) -> np.ndarray:
        return self.to_numpy(self._graphs[id(states)].outputs[-1])
