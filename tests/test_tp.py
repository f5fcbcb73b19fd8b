"""Tensor parallel over two ranks (ds4/tp, core/tp_split.py, wire.md §2).

* the split: rank 0 + rank 1 reassemble every split tensor byte for byte; the shared expert on
  rank 0 only; the bytes each rank binds; indivisible configs and block-cutting column splits
  refused, naming the dimension / tensor;
* exactness: leader + worker (a thread, over loopback) against one rank: the same greedy tokens
  and logits within 1e-5 (exact numerics), for reference/mlx on either end; ds4 numerics;
  Triton (opt-in on CPU, where its interpreter takes minutes);
* the other session calls mirrored (rewind, snapshot / restore, invalidate, prefix syncs,
  sampling with an rng); sessions dropped on the leader destroyed on the worker;
* --debug-hash: clean on equal ranks and on ranks of different backends (they run canonical);
  a worker whose hidden state drifts at one step -> TPError naming the layer and the step;
* payloads between a TP session and a one-rank session, both ways;
* faults (the worker a subprocess): killed mid-decode, frozen (SIGSTOP) -> TPError within the
  gate timeout; a worker that died while the leader idled; a restarted worker joins the same
  leader;
* hello: a worker on another model is refused naming the fingerprint on both ends; a wrong
  shared secret is refused without a hang;
* gloo gates (torch.distributed): the same tokens and logits bit for bit as TCP gates;
* a session's own prefill_cap reaches the worker; the Triton FFN ops stay decode-step ops.

Every model and prompt is seeded; nothing here is drawn fresh per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import signal
import socket
import threading
import time

import numpy as np
import pytest
from tp_helpers import (ProcWorker, ThreadWorker, leader_on, one_rank_run, rank_engine, rel,
                        threaded_pair, tp_run)

import ds4
from ds4.core.config import ConfigError
from ds4.core.default_model import default_model_path
from ds4.core.gguf_model import GGUFModel, Tensor
from ds4.core.quants import GGMLType, row_bytes
from ds4.core.tiny import make_tiny
from ds4.core.tp_split import RankPart, Split, split_of
from ds4.core.weights import bind_weights
from ds4.tp import Options, TPEngine, TPError, TPRefused
from ds4.wire import ds4t

CTX = 128
N_GEN = 64
EXACT_RTOL = 1e-5
# ds4 numerics round K/V to FP8 and the indexer to FP4: a last-bit difference from the gate's
# summation order can move one rounding, so they get the bound of one backend against another
# (test_triton_model.py); the measured values are in the README's tensor-parallel table.
DS4_RTOL = 1e-3
GATE_MS = 20000  # generous for the threaded pairs: the two ranks share two cores and a GIL
HAS_MLX = importlib.util.find_spec("mlx") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The test preset (5 layers, 8 experts, 512 tokens, window 8, ratios 4 and 8), seed 0."""
    return make_tiny(tmp_path_factory.mktemp("tp") / "test-s0.gguf", preset="test", seed=0)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The same shapes, another seed: another fingerprint."""
    return make_tiny(tmp_path_factory.mktemp("tp") / "test-s1.gguf", preset="test", seed=1)


# 16 tokens: slide the 8-row window, close 4 ratio-4 and 2 ratio-8 windows, overflow top-4;
# the 64 generated tokens run on to position 80.
PROMPT = _prompt(1, 16, 512)


class Engines:
    """Each bound engine once per module: (backend, numerics, rank) -> Engine; rank None = one rank."""

    def __init__(self, path):
        self.path = path
        self._e = {}
        self._runs = {}

    def get(self, backend: str, numerics: str, rank: int | None):
        key = (backend, numerics, rank)
        if key not in self._e:
            if rank is None:
                self._e[key] = ds4.Engine.open(self.path, backend=backend, numerics=numerics)
            else:
                self._e[key] = rank_engine(self.path, backend, numerics, rank)
        return self._e[key]

    def one_rank(self, numerics: str, prompt=PROMPT, n: int = N_GEN):
        key = (numerics, tuple(prompt), n)
        if key not in self._runs:
            self._runs[key] = one_rank_run(self.get("reference", numerics, None), prompt, n, CTX)
        return self._runs[key]


@pytest.fixture(scope="module")
def engines(model):
    return Engines(model)


# ---- the split --------------------------------------------------------------------------------


def _reassemble(t: Tensor, a: Tensor, b: Tensor) -> bytes:
    how = split_of(t.name)
    if how in (Split.SINKS_BY_HEAD, Split.COLS_BY_GROUP):  # the inner axis: join each row
        ra, rb = a.raw.reshape(-1, a.row_bytes), b.raw.reshape(-1, b.row_bytes)
        return np.concatenate([ra, rb], axis=1).tobytes()
    return a.raw.tobytes() + b.raw.tobytes()  # the outer axis: rank 0's rows, then rank 1's


def test_split_reassembles_every_split_tensor():
    m = GGUFModel(default_model_path())  # the embedded tiny model: the real vocabulary and type mix
    cfg = m.config
    r0, r1 = RankPart.of(cfg, 2, 0), RankPart.of(cfg, 2, 1)
    seen = {s: 0 for s in Split}
    for name, t in m.tensors.items():
        how = split_of(name)
        seen[how] += 1
        if how == Split.WHOLE:
            assert r0.slice(t, cfg) is t and r1.slice(t, cfg) is t
            continue
        if how == Split.RANK0_ONLY:
            assert r0.holds(name) and not r1.holds(name), name
            assert r0.slice(t, cfg) is t
            with pytest.raises(ValueError, match="shared expert"):
                r1.slice(t, cfg)
            continue
        a, b = r0.slice(t, cfg), r1.slice(t, cfg)
        assert a.type == b.type == t.type and a.name == b.name == t.name
        assert _reassemble(t, a, b) == t.raw.tobytes(), name
        # each half is half of the split axis
        axis = 0 if how in (Split.SINKS_BY_HEAD, Split.COLS_BY_GROUP) else -1
        assert a.dims[axis] == b.dims[axis] == t.dims[axis] // 2, (name, a.dims, b.dims, t.dims)
        assert a.n_bytes == b.n_bytes == t.n_bytes // 2, name
    L = cfg.n_layer
    assert seen[Split.EXPERTS] == 3 * L and seen[Split.RANK0_ONLY] == 3 * L
    assert seen[Split.ROWS_BY_HEAD] == seen[Split.ROWS_BY_GROUP] == L
    assert seen[Split.SINKS_BY_HEAD] == seen[Split.COLS_BY_GROUP] == L
    assert seen[Split.VOCAB_ROWS] == 1
    # the indexer's own q_b is not a head split
    assert split_of("blk.2.indexer.attn_q_b.weight") == Split.WHOLE
    assert (r0.vocab.start, r0.vocab.stop, r1.vocab.stop) == (0, cfg.n_vocab // 2, cfg.n_vocab)


def _bound(m: GGUFModel, part) -> dict[str, int]:
    """name -> bytes uploaded by bind_weights for this part (None: one rank)."""
    got = {}

    def upload(t: Tensor):
        assert t.name not in got
        got[t.name] = t.n_bytes
        return t.name

    w = bind_weights(m, upload, part=part)
    if part is not None:
        for L in w.layers.values() if isinstance(w.layers, dict) else w.layers:
            assert (L.ffn_gate_shexp is None) == (not part.shared_expert)
            assert L.experts == part.experts
    return got


def test_split_bytes_per_rank():
    m = GGUFModel(default_model_path())
    cfg = m.config
    one = _bound(m, None)
    ranks = [_bound(m, RankPart.of(cfg, 2, r)) for r in range(2)]

    def total(d, pick=lambda n: True):
        return sum(v for n, v in d.items() if pick(n))

    exps = lambda n: n.endswith("_exps.weight")  # noqa: E731
    shexp = lambda n: n.endswith("_shexp.weight")  # noqa: E731
    assert total(ranks[0], exps) == total(ranks[1], exps) == total(one, exps) // 2
    assert total(ranks[0], shexp) == total(one, shexp) > 0 and total(ranks[1], shexp) == 0
    for name, size in one.items():  # whole on both, split in half, or rank 0's only
        how = split_of(name)
        if how == Split.WHOLE:
            assert ranks[0][name] == ranks[1][name] == size, name
        elif how == Split.RANK0_ONLY:
            assert ranks[0][name] == size and name not in ranks[1]
        else:
            assert ranks[0][name] + ranks[1][name] == size, name
    # (the embedding, mHC, router, KV path, compressors and indexer stay whole on both ranks)
    print(f"bound bytes: one rank {total(one)}, rank 0 {total(ranks[0])}, rank 1 {total(ranks[1])}")
    assert total(ranks[0]) < total(one) and total(ranks[1]) < total(ranks[0])


@pytest.mark.parametrize("field, named", [("n_head", "head_count"),
                                          ("o_groups", "output_group_count"),
                                          ("n_expert", "expert_count")])
def test_split_refuses_an_indivisible_dimension(field, named):
    cfg = GGUFModel(default_model_path()).config
    odd = dataclasses.replace(cfg, **{field: getattr(cfg, field) + 1})
    with pytest.raises(ConfigError, match=named):
        RankPart.of(odd, 2, 0)
    RankPart.of(odd, 1, 0)  # one rank holds everything, whatever the counts


def test_split_refuses_a_column_split_that_cuts_a_block():
    cfg = GGUFModel(default_model_path()).config
    # 2 groups of 16 columns: rank 1's columns start at 16, inside the first 32-value Q8_0 block
    cfg = dataclasses.replace(cfg, o_lora_rank=16, o_groups=2)
    name = "blk.3.attn_output_b.weight"
    cols, rows = cfg.o_groups * cfg.o_lora_rank, 8
    t = Tensor(name, GGMLType.Q8_0, (cols, rows), np.zeros(rows * row_bytes(GGMLType.Q8_0, cols), np.uint8))
    for r in range(2):
        with pytest.raises(ConfigError, match=re.escape(name)):
            RankPart.of(cfg, 2, r).slice(t, cfg)
    # 2 groups of 32 cut on a block edge: accepted
    ok = dataclasses.replace(cfg, o_lora_rank=32)
    t = Tensor(name, GGMLType.Q8_0, (64, rows), np.zeros(rows * row_bytes(GGMLType.Q8_0, 64), np.uint8))
    assert RankPart.of(ok, 2, 1).slice(t, ok).dims == (32, rows)


# ---- exactness: two ranks against one ------------------------------------------------------------


def _check_against_one_rank(engines, tp, numerics, rtol, prompt=PROMPT, n=N_GEN):
    first, toks, last = tp_run(tp, prompt, n)
    want_first, want_toks, want_last = engines.one_rank(numerics, prompt, n)
    assert toks == want_toks
    r_first, r_last = rel(first, want_first), rel(last, want_last)
    assert r_first <= rtol and r_last <= rtol, (r_first, r_last)
    return first, toks, last


PAIRS = [("reference", "reference"),
         pytest.param("reference", "mlx", marks=pytest.mark.skipif(not HAS_MLX, reason="needs mlx")),
         pytest.param("mlx", "reference", marks=pytest.mark.skipif(not HAS_MLX, reason="needs mlx"))]


@pytest.mark.parametrize("lead_backend, worker_backend", PAIRS)
def test_exact_two_ranks_equal_one(engines, lead_backend, worker_backend):
    lead = engines.get(lead_backend, "exact", 0)
    work = engines.get(worker_backend, "exact", 1)
    with threaded_pair(lead, work, CTX) as tp:
        _check_against_one_rank(engines, tp, "exact", EXACT_RTOL)


def test_ds4_numerics_two_ranks_equal_one(engines):
    lead = engines.get("reference", "ds4", 0)
    work = engines.get("reference", "ds4", 1)
    with threaded_pair(lead, work, CTX) as tp:
        _check_against_one_rank(engines, tp, "ds4", DS4_RTOL)


def test_exact_on_the_embedded_tiny_model():
    """The real 129280-token vocabulary (a 64640-row head on each rank) and ratio-16 layers."""
    p = default_model_path()
    one = ds4.Engine.open(p, backend="reference", numerics="exact")
    prompt = _prompt(2, 12, 129280)
    want = one_rank_run(one, prompt, 24, CTX)
    with threaded_pair(rank_engine(p, "reference", "exact", 0), rank_engine(p, "reference", "exact", 1),
                       CTX) as tp:
        got = tp_run(tp, prompt, 24)
    assert got[1] == want[1]
    assert rel(got[0], want[0]) <= EXACT_RTOL and rel(got[2], want[2]) <= EXACT_RTOL


def test_rewind_snapshot_and_sync_are_mirrored(engines):
    """Session calls other than sync/eval keep the worker in step (one rank does the same)."""
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    one = engines.get("reference", "exact", None).session(ctx=CTX)
    with threaded_pair(lead, work, CTX) as tp:
        s = tp.session()
        for sess in (s, one):
            sess.sync(PROMPT)
        snap, snap1 = s.snapshot(), one.snapshot()
        assert list(s.greedy(6)) == list(one.greedy(6))
        for sess in (s, one):
            sess.rewind(len(PROMPT) + 2)
        assert list(s.greedy(4)) == list(one.greedy(4))
        s.restore(snap)
        one.restore(snap1)
        assert list(s.greedy(4)) == list(one.greedy(4))
        for sess in (s, one):  # a sync sharing a prefix, then one that diverges early
            sess.sync(PROMPT + [7, 8, 9])
        assert list(s.greedy(3)) == list(one.greedy(3))
        for sess in (s, one):
            sess.sync(PROMPT[:5])
        assert list(s.greedy(3)) == list(one.greedy(3))
        assert rel(s.logits, one.logits) <= EXACT_RTOL
        s.invalidate()
        assert s.tokens == []
        s.sync(PROMPT[:3])
        one.sync(PROMPT[:3])
        assert rel(s.logits, one.logits) <= EXACT_RTOL


def test_sampling_with_an_rng_equals_one_rank(engines):
    from ds4.core.sampling import Rng, SamplingParams

    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    one = engines.get("reference", "exact", None).session(ctx=CTX)
    one.sync(PROMPT)
    want = list(one.sample(16, params, Rng(7)))
    with threaded_pair(lead, work, CTX) as tp:
        s = tp.session()
        s.sync(PROMPT)
        assert list(s.sample(16, params, Rng(7))) == want


def test_dropped_sessions_are_destroyed_on_the_worker(engines):
    import gc

    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    held = {}
    with threaded_pair(lead, work, CTX, before_serve=lambda w: held.setdefault("w", w)) as tp:
        a, b = tp.session(), tp.session()
        a.sync(PROMPT[:4])
        b.sync(PROMPT[:5])
        assert set(held["w"].sessions) == {a.sid, b.sid}
        gone = a.sid
        del a
        gc.collect()
        b.eval(3)  # (the next command first destroys the dropped session on the worker)
        assert set(held["w"].sessions) == {b.sid}, gone
        b.close()
        assert held["w"].sessions == {}


def test_a_wrong_shared_secret_is_refused_without_a_hang(engines):
    lead = engines.get("reference", "exact", 0)
    tp = leader_on(lead, CTX, Options(auth_token="right", gate_timeout_ms=GATE_MS), wait_s=3)
    w = ThreadWorker(tp.address, engine=engines.get("reference", "exact", 1),
                     opts=Options(auth_token="wrong", gate_timeout_ms=GATE_MS, io_timeout=5))
    t0 = time.monotonic()
    try:
        with pytest.raises(TPError, match="no worker joined within the wait of 3 s"):
            tp.ensure_worker()  # (the leader goes on waiting for a real worker until wait_s)
    finally:
        tp.close()
        w.join()
    assert time.monotonic() - t0 < 10
    assert isinstance(w.error, TPError) and "auth" in str(w.error), repr(w.error)


class _Stranger:
    """A peer on the leader's port (a thread) that reads the leader's hello and answers with
    reply(hello) (raw bytes; None: nothing, it stalls), then holds the connection until closed."""

    def __init__(self, address, reply):
        self.sock = socket.create_connection(address, timeout=30)

        def run():
            with contextlib.suppress(OSError, ds4t.DS4TError):
                hello = ds4t.Hello.unpack(ds4t.recv_exact(self.sock, ds4t.HELLO.size, 30, "the hello"))
                answer = reply(hello)
                if answer is not None:
                    self.sock.sendall(answer)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(30)


def test_a_strangers_hello_does_not_end_the_leaders_wait(engines):
    """With a shared secret, a hello that does not fit counts only from a peer that proved the
    secret: a stranger's (the leader's own hello played back as a worker's, without the auth
    flag) is dropped and the leader goes on to pair with the real worker."""
    opts = Options(auth_token="tok", gate_timeout_ms=GATE_MS)
    tp = leader_on(engines.get("reference", "exact", 0), CTX, opts, wait_s=30)
    stranger = _Stranger(tp.address, lambda h: dataclasses.replace(
        h, role=ds4t.Role.WORKER, rank=1, flags=0).pack())
    w = ThreadWorker(tp.address, engine=engines.get("reference", "exact", 1), opts=opts)
    try:
        tp.ensure_worker()
        assert tp_run(tp, PROMPT[:4], 2)[1]  # the pair works
    finally:
        stranger.close()
        tp.close()
        w.join()
    assert w.error is None, repr(w.error)


def test_a_stalled_connection_does_not_hold_up_the_worker(engines):
    """A connection that sends nothing holds up only itself: the leader handshakes each
    connection on its own thread, so the worker behind it pairs within its own io timeout."""
    tp = leader_on(engines.get("reference", "exact", 0), CTX,
                   Options(gate_timeout_ms=GATE_MS, io_timeout=4), wait_s=30)
    stalled = _Stranger(tp.address, lambda h: None)
    w = ThreadWorker(tp.address, engine=engines.get("reference", "exact", 1),
                     opts=Options(gate_timeout_ms=GATE_MS, io_timeout=1))
    try:
        tp.ensure_worker()
        assert tp_run(tp, PROMPT[:4], 2)[1]
    finally:
        stalled.close()
        tp.close()
        w.join()
    assert w.error is None, repr(w.error)


def test_a_stranger_stalling_in_the_proof_is_passed_by(engines):
    """With a shared secret, a stranger whose hello fits (the leader's own, played back as a
    worker's) and who then stalls before proving the secret, accepted ahead of the worker, does
    not hold the worker's connections back: the leader hands out the first connections that
    complete, waiting only for older ones whose peer has proven the secret."""
    io_timeout = 20
    opts = Options(auth_token="tok", gate_timeout_ms=GATE_MS, io_timeout=io_timeout)
    tp = leader_on(engines.get("reference", "exact", 0), CTX, opts, wait_s=60)
    stranger = _Stranger(tp.address, lambda h: dataclasses.replace(h, role=ds4t.Role.WORKER, rank=1).pack())
    w = ThreadWorker(tp.address, engine=engines.get("reference", "exact", 1), opts=opts)
    t0 = time.monotonic()
    try:
        tp.ensure_worker()
        paired = time.monotonic() - t0
        assert tp_run(tp, PROMPT[:4], 2)[1]
    finally:
        stranger.close()
        tp.close()
        w.join()
    assert paired < io_timeout / 2, paired  # (not behind the stranger's proof timeout)
    assert w.error is None, repr(w.error)


def test_silent_strangers_filling_the_handshakes_do_not_keep_the_worker_out(engines):
    """With a shared secret, as many silent connections as the leader handshakes at once do not
    turn the worker away: a newer connection takes the place of the oldest whose peer has not
    proven the secret (the leader used to close the newcomer, and the worker gave up)."""
    from ds4.tp.link import MAX_HANDSHAKES

    io_timeout = 20
    opts = Options(auth_token="tok", gate_timeout_ms=GATE_MS, io_timeout=io_timeout)
    tp = leader_on(engines.get("reference", "exact", 0), CTX, opts, wait_s=60)
    strangers = [_Stranger(tp.address, lambda h: None) for _ in range(MAX_HANDSHAKES)]
    w = None
    t0 = time.monotonic()
    try:
        done = threading.Thread(target=tp.ensure_worker, daemon=True)
        done.start()
        time.sleep(1.0)  # (the leader has taken up every stranger)
        w = ThreadWorker(tp.address, engine=engines.get("reference", "exact", 1), opts=opts)
        done.join(io_timeout)
        paired = time.monotonic() - t0
        assert not done.is_alive()
        assert tp_run(tp, PROMPT[:4], 2)[1]
    finally:
        for st in strangers:
            st.close()
        tp.close()
        if w is not None:
            w.join()
    assert paired < io_timeout / 2, paired
    assert w.error is None, repr(w.error)


def test_past_its_deadline_the_leader_does_not_wait_for_a_silent_stranger(engines):
    """A handshake under way at the deadline is waited for (up to the io timeout) only if its
    peer has proven the secret or it began within PROOF_GRACE_S: a stranger that connected and
    stays silent no longer stretches a short wait (the serve probe's) to the io timeout."""
    from ds4.tp.link import PROOF_GRACE_S

    io_timeout = 30
    opts = Options(auth_token="tok", gate_timeout_ms=GATE_MS, io_timeout=io_timeout)
    tp = leader_on(engines.get("reference", "exact", 0), CTX, opts, wait_s=1)
    stranger = _Stranger(tp.address, lambda h: None)
    t0 = time.monotonic()
    try:
        with pytest.raises(TPError, match="no worker joined within the wait of 1 s"):
            tp.ensure_worker()
    finally:
        stranger.close()
        tp.close()
    assert time.monotonic() - t0 < 1 + PROOF_GRACE_S + 3, time.monotonic() - t0


def test_the_leader_refuses_hashes_it_did_not_ask_for(engines, monkeypatch):
    """Hidden-state hashes from a worker of a pair without --debug-hash are a protocol error
    (they would pile up on the leader), not collected."""
    from ds4.tp.partner import LayerHash, WirePartner

    monkeypatch.setattr(WirePartner, "take_hashes", lambda self: [LayerHash(1, 0, 7)])
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    with threaded_pair(lead, work, CTX, check_worker=False) as tp:
        with pytest.raises(TPError, match="HASH.*without --debug-hash"):
            tp_run(tp, PROMPT[:4], 1)


def test_the_leader_refuses_logits_for_a_command_that_has_none(engines, monkeypatch):
    """A worker's LOGITS for a command that left the leader's logits whole (a rewind to where
    the session already is) is a protocol error; the leader used to append them, giving a row
    of one and a half vocabularies."""
    from ds4.engine import Session

    rewind = Session.rewind

    def rewind_and_send(self, pos):  # (the worker: new logits make it send them)
        rewind(self, pos)
        if self._logits is not None:
            self._logits = self._logits.copy()

    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    with threaded_pair(lead, work, CTX, check_worker=False) as tp:
        s = tp.session()
        s.sync(PROMPT[:4])
        monkeypatch.setattr(Session, "rewind", rewind_and_send)
        with pytest.raises(Exception, match="logits for a command that has none"):
            s.rewind(4)


def test_session_prefill_cap_reaches_the_worker(engines):
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    one = engines.get("reference", "exact", None).session(ctx=CTX, prefill_cap=4)
    one.sync(PROMPT)
    with threaded_pair(lead, work, CTX, check_worker=False) as tp:
        s = tp.session(prefill_cap=4)
        s.sync(PROMPT)  # (4-row chunks on both ranks: SESSION_CREATE carries the cap)
        assert rel(s.logits, one.logits) <= EXACT_RTOL


def test_each_chunk_is_announced_to_the_partner_before_its_gates(engines):
    """forward_chunk tells the partner a chunk's position, rows and whether it has logits before
    the chunk's first gate (the torch transport checks both ranks' chunk there): a 10-token prompt
    in chunks of 4, then one decode step. The partner here is one rank's: its gates add nothing."""
    from ds4.tp.partner import _Base

    events = []

    class Recorder(_Base):
        def begin_chunk(self, p0, rows, logits):
            events.append(("chunk", p0, rows, logits))

        def gate(self, be, il, gate, partial):
            events.append(("gate",))
            return partial

    eng = engines.get("reference", "exact", None)
    eng.partner = Recorder(0)
    try:
        s = eng.session(ctx=CTX, prefill_cap=4)
        s.sync(PROMPT[:10])
        s.eval(PROMPT[10])
    finally:
        eng.partner = None
    chunks = [e[1:] for e in events if e[0] == "chunk"]
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True), (10, 1, True)]
    starts = [i for i, e in enumerate(events) if e[0] == "chunk"]
    gates_per_chunk = [starts[i + 1] - starts[i] - 1 for i in range(len(starts) - 1)]
    assert starts[0] == 0 and gates_per_chunk == [2 * eng.config.n_layer] * 3


TRITON_CPU_OPT_IN = "DS4_TEST_TP_TRITON"


def _triton_device() -> str | None:
    """'cuda', 'cpu' (the interpreter, opt-in: ~4.5 minutes on a 2-core machine) or None (skip)."""
    if not HAS_TORCH or importlib.util.find_spec("triton") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get(TRITON_CPU_OPT_IN) == "1":
        return "cpu"
    return None


@pytest.mark.skipif(_triton_device() is None,
                    reason=f"needs triton on a GPU, or under TRITON_INTERPRET=1 with {TRITON_CPU_OPT_IN}=1 "
                    "(under the interpreter this test takes ~4.5 minutes on a 2-core machine)")
def test_triton_leader_reference_worker(engines):
    dev = _triton_device()
    lead = rank_engine(engines.path, "triton", "exact", 0, device=dev)
    work = engines.get("reference", "exact", 1)
    prompt = PROMPT[:6]
    # the interpreter spends over 20 s between two gates of one layer (the experts)
    opts = Options(gate_timeout_ms=600_000 if dev == "cpu" else GATE_MS)
    with threaded_pair(lead, work, CTX, lead_opts=opts, worker_opts=opts) as tp:
        first, toks, last = tp_run(tp, prompt, 4)
    want_first, want_toks, want_last = engines.one_rank("exact", prompt, 4)
    assert toks == want_toks
    # triton against the reference is held to 1e-3 in exact numerics (test_triton_model.py)
    assert rel(first, want_first) <= 1e-3 and rel(last, want_last) <= 1e-3


# A model small enough for Triton's interpreter: three layers of every kind, F16 experts, Q8_0
# dense weights (the output projection's column cut, one group of 32 values, is one Q8_0 block).
MINI = dict(n_layer=3, n_embd=64, n_head=2, head_dim=64, n_rot=32, q_lora_rank=32, o_lora_rank=32,
            o_groups=2, n_expert=4, n_expert_used=2, n_ff_exp=32, n_hash_layer=1, sliding_window=6,
            indexer_heads=2, indexer_head_dim=32, indexer_top_k=3, compress_ratios=(0, 4, 8))


@pytest.mark.skipif(not HAS_TORCH or importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_leader_reference_worker_mini(tmp_path):
    """The same pair on every machine CI has: the Triton rank runs interpreted on the CPU."""
    from ds4.core.quants import GGMLType as T
    from ds4.core.tiny import make_synthetic, preset_config

    cfg = preset_config("test", **MINI, name="tp-mini")
    experts = {f"ffn_{k}_exps.weight": T.F16 for k in ("gate", "up", "down")}
    path = make_synthetic(tmp_path / "mini.gguf", cfg, experts, seed=5)
    prompt, n = PROMPT[:8], 4
    import torch

    lead = rank_engine(path, "triton", "exact", 0, device="cuda" if torch.cuda.is_available() else "cpu")
    work = rank_engine(path, "reference", "exact", 1)
    opts = Options(gate_timeout_ms=120_000)  # (the interpreter is slow between two gates)
    with threaded_pair(lead, work, CTX, lead_opts=opts, worker_opts=opts) as tp:
        first, toks, last = tp_run(tp, prompt, n)
    one = ds4.Engine.open(path, backend="reference", numerics="exact")
    want_first, want_toks, want_last = one_rank_run(one, prompt, n, CTX)
    assert toks == want_toks
    # Triton against the reference is held to 1e-3 in exact numerics (test_triton_model.py)
    assert rel(first, want_first) <= 1e-3 and rel(last, want_last) <= 1e-3


@pytest.mark.skipif(not HAS_TORCH or importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_ops_of_the_ffn_go_through_the_decode_step_machinery():
    from ds4.backends import backend_class

    B = backend_class("triton")
    wrapped = B.moe.__code__  # every @_op method is the same wrapper
    for name in ("router", "expert_part", "shared_expert"):
        assert getattr(B, name).__code__ is wrapped, f"{name} is not an @_op"


# ---- --debug-hash -------------------------------------------------------------------------------


def test_debug_hash_clean_on_equal_ranks(engines):
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    opts = Options(gate_timeout_ms=GATE_MS, debug_hash=True)
    with threaded_pair(lead, work, CTX, lead_opts=opts) as tp:
        assert tp.pair.debug_hash
        first, toks, last = tp_run(tp, PROMPT, 8)
        # the worker adopted the leader's choice (it was opened without debug_hash)
    assert toks == engines.one_rank("exact", PROMPT, 8)[1]


@pytest.mark.skipif(not HAS_MLX, reason="needs mlx")
def test_debug_hash_clean_on_ranks_of_different_backends(engines):
    """Ranks on different backends run canonical (the worker adopts the leader's routing and
    hidden state), so their hidden states are equal bit for bit after every layer."""
    lead, work = engines.get("reference", "exact", 0), engines.get("mlx", "exact", 1)
    opts = Options(gate_timeout_ms=GATE_MS, debug_hash=True)
    with threaded_pair(lead, work, CTX, lead_opts=opts) as tp:
        first, toks, last = tp_run(tp, PROMPT, 8)
    want = engines.one_rank("exact", PROMPT, 8)
    assert toks == want[1] and rel(last, want[2]) <= EXACT_RTOL


def test_debug_hash_names_the_layer_and_step_of_a_drifted_worker(engines, monkeypatch):
    """A worker whose FFN sum of layer 2 is off by one ulp-ish at one decode step only."""
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    bad_pos = len(PROMPT) + 3  # the 4th generated token's step
    seen = {"p0": -1}
    real_begin = work.backend.begin_chunk
    monkeypatch.setattr(work.backend, "begin_chunk",
                        lambda states, tokens, p0, logits: (seen.__setitem__("p0", p0),
                                                            real_begin(states, tokens, p0, logits))[1])

    def drift(worker):
        partner = worker.pair.partner
        real_gate = partner.gate

        def gate(be, il, gate, partial):
            out = real_gate(be, il, gate, partial)
            if seen["p0"] == bad_pos and il == 2 and int(gate) == 1:
                out = np.array(out, dtype=np.float32, copy=True)
                out.reshape(-1)[0] += np.float32(1e-3)
            return out

        partner.gate = gate

    opts = Options(gate_timeout_ms=GATE_MS, debug_hash=True)
    with threaded_pair(lead, work, CTX, lead_opts=opts, before_serve=drift, check_worker=False) as tp:
        s = tp.session()
        s.sync(PROMPT)
        got = []
        with pytest.raises(TPError) as ei:
            for t in s.greedy(8):
                got.append(t)
    msg = str(ei.value)
    assert "decode" in msg and "layer 2" in msg, msg
    step = int(re.search(r"step (\d+)", msg).group(1))
    # (the step is the token count the session held after the failed step: position + 1)
    assert step in (bad_pos, bad_pos + 1), msg
    assert len(got) == 3, got  # the first three steps were clean


# ---- payloads between a TP session and one rank ----------------------------------------------------


def test_payload_from_tp_to_one_rank(engines, tmp_path):
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    one = engines.get("reference", "exact", None)
    path = tmp_path / "tp.dsv4"
    with threaded_pair(lead, work, CTX) as tp:
        s = tp.session()
        s.sync(PROMPT)
        s.save_payload(path)
        tp_next = list(s.greedy(16))
    o = one.session(ctx=CTX)
    o.load_payload(path)
    assert o.tokens == PROMPT
    assert list(o.greedy(16)) == tp_next


def test_payload_from_one_rank_to_tp(engines, tmp_path):
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    one = engines.get("reference", "exact", None)
    path = tmp_path / "one.dsv4"
    o = one.session(ctx=CTX)
    o.sync(PROMPT)
    o.save_payload(path)
    want = list(o.greedy(16))
    with threaded_pair(lead, work, CTX) as tp:
        s = tp.session()
        s.load_payload(path)
        assert s.tokens == PROMPT
        assert list(s.greedy(16)) == want
        assert rel(s.logits, o.logits) <= EXACT_RTOL


# ---- faults: the worker in a subprocess ------------------------------------------------------------

FAULT_GATE_MS = 1500
FAULT_IO_S = 10.0


@pytest.fixture
def sub_leader(model):
    """A leader for a fault test (TPEngine.open, its own engine), up across worker restarts."""
    tp = TPEngine.open(model, ("127.0.0.1", 0), backend="reference", numerics="exact", ctx=CTX,
                       connect=False, wait_s=60,
                       opts=Options(gate_timeout_ms=FAULT_GATE_MS, io_timeout=FAULT_IO_S))
    yield tp
    tp.close()


def _start_worker(model, tp, tmp_path, name, **kw) -> ProcWorker:
    return ProcWorker(model, tp.address, tmp_path / f"{name}.log", gate_timeout_ms=FAULT_GATE_MS,
                      io_timeout=FAULT_IO_S, **kw)


def _rejoin_and_check(engines, model, tp, tmp_path, name, old_session):
    """A new worker joins the same leader: a new session, and the old one from empty, work."""
    w = _start_worker(model, tp, tmp_path, name)
    try:
        want = engines.one_rank("exact", PROMPT, 16)
        s = tp.session()
        s.sync(PROMPT)
        assert list(s.greedy(16)) == want[1]
        old_session.sync(PROMPT[:8])  # the failed session restarts empty on the new worker
        assert old_session.tokens == PROMPT[:8]
        return w
    except BaseException:
        print(w.output())
        raise


def test_fault_worker_killed_mid_decode(engines, model, sub_leader, tmp_path):
    tp = sub_leader
    w = _start_worker(model, tp, tmp_path, "w1")
    killed = {}
    try:
        s = tp.session()
        s.sync(PROMPT)

        def kill():
            killed["t"] = time.monotonic()
            w.proc.send_signal(signal.SIGKILL)

        got = []
        with pytest.raises(TPError) as ei:
            for t in s.greedy(N_GEN):
                got.append(t)
                if len(got) == 3:  # lands inside one of the next steps
                    threading.Timer(0.005, kill).start()
        waited = time.monotonic() - killed["t"]
    finally:
        w.kill()
    msg = str(ei.value)
    assert "decode" in msg, msg
    assert waited < FAULT_GATE_MS / 1000 + 2.0, waited
    assert 3 <= len(got) < N_GEN
    assert s.tokens == [] and tp.pair is None  # invalidated; the pair dropped, the leader up
    w2 = _rejoin_and_check(engines, model, tp, tmp_path, "w2", s)
    # a worker that dies while the leader is idle: the next command sees the closed connection
    # and fails at once (not after the leader's 60 s wait for a worker); the one after it waits
    w2.kill()
    s2 = tp.session()
    with pytest.raises(TPError, match="the worker closed its connection"):
        s2.sync(PROMPT)
    assert tp.pair is None
    w3 = _rejoin_and_check(engines, model, tp, tmp_path, "w3", s2)
    w3.kill()


def test_fault_worker_frozen(engines, model, sub_leader, tmp_path):
    tp = sub_leader
    w = _start_worker(model, tp, tmp_path, "w4")
    try:
        s = tp.session()
        s.sync(PROMPT)
        tok = int(np.argmax(s.logits))
        os.kill(w.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TPError) as ei:
            s.eval(tok)
        waited = time.monotonic() - t0
    finally:
        w.kill()  # (SIGKILL ends a stopped process too)
    msg = str(ei.value)
    assert "decode" in msg and "timeout" in msg, msg
    assert FAULT_GATE_MS / 1000 * 0.9 <= waited < FAULT_GATE_MS / 1000 + 2.0, waited
    w2 = _rejoin_and_check(engines, model, tp, tmp_path, "w5", s)
    w2.kill()


# ---- hello ---------------------------------------------------------------------------------------


def test_hello_refuses_a_worker_on_another_model(engines, other_model):
    tp = leader_on(engines.get("reference", "exact", 0), CTX, wait_s=30)
    w = ThreadWorker(tp.address, engine=rank_engine(other_model, "reference", "exact", 1))
    try:
        with pytest.raises(TPRefused, match="fingerprint"):
            tp.ensure_worker()
    finally:
        tp.close()
        w.join()
    assert isinstance(w.error, TPRefused), repr(w.error)
    assert "fingerprint" in str(w.error)


# ---- gloo gates ------------------------------------------------------------------------------------


def _an_address_beside_loopback() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # (TEST-NET-1: a UDP connect only picks the route)
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_the_torch_gates_store_listens_on_the_leaders_address_only():
    """TCPStore listens on every interface by itself; the leader's store takes a socket bound
    to its own address, and its keys live under the pair's prefix."""
    from datetime import timedelta

    import torch.distributed as dist

    from ds4.tp.partner import TorchPartner

    other = _an_address_beside_loopback()
    if other is None:
        pytest.skip("no address besides loopback")
    store, port = TorchPartner.open_store("127.0.0.1", 2000, "pfx/")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, port), timeout=5).close()
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    dist.PrefixStore("pfx/", client).set("k", "v")
    assert store.get("k") == b"v"
    assert not client.check(["k"])  # (outside the prefix, nothing)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_gloo_gates_equal_tcp_gates_bit_for_bit(engines, model, tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    lead, work = engines.get("reference", "exact", 0), engines.get("reference", "exact", 1)
    with threaded_pair(lead, work, CTX) as tp:
        want = tp_run(tp, PROMPT, N_GEN)
    opts = Options(transport="gloo", gate_timeout_ms=GATE_MS)
    tp = leader_on(lead, CTX, opts)
    w = ProcWorker(model, tp.address, tmp_path / "gloo.log", transport="gloo", gate_timeout_ms=GATE_MS)
    try:
        tp.ensure_worker()
        got = tp_run(tp, PROMPT, N_GEN)
        tp.close()
        assert w.wait(60) == 0, w.output()
    finally:
        tp.close()
        w.kill()
        if dist.is_initialized():  # (a failed run: leave no process group behind)
            dist.destroy_process_group()
    assert got[1] == want[1]
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[2], want[2])


@pytest.mark.parametrize("word, field, got, want", [
    (1, "layer", "layer 3", "expected 2"),
    (2, "gate", "gate 1", "expected 0"),
    (3, "seq", "seq 8", "expected 7"),
    (5, "rows", "rows 5", "expected 4"),
    (6, "rank", "rank 0", "expected 1"),
])
def test_a_torch_gate_record_names_the_field_that_differs(word, field, got, want):
    """The torch transport's record header: a desync names the field whose word differs, with
    both values (it used to say "gate" for every field, and print a bare list)."""
    from ds4.tp.partner import check_record_header
    from ds4.wire import ds4t

    mine = [ds4t.GATE_MAGIC, 2, 0, 7, 0, 4, 1, 0]  # layer 2, gate 0, seq 7, 4 rows, rank 1
    theirs = list(mine)
    theirs[word] += 1 if word != 6 else -1
    check_record_header(list(mine), mine, 1)
    with pytest.raises(ds4t.GateDesync, match=f"rank 1's record has {got}, {want}") as e:
        check_record_header(theirs, mine, 1)
    assert e.value.field == field


_CHUNK_RANK = """
import sys
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from ds4.core.tp_split import Gate
from ds4.tp.partner import TorchPartner
from ds4.wire import ds4t

rank, port, rows = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))


class Host:
    @staticmethod
    def to_numpy(x):
        return x

    @staticmethod
    def from_numpy(x):
        return x


p = TorchPartner(rank, "cpu")
try:
    p.begin_chunk(7, rows, True)
    p.gate(Host, 0, Gate.ATTN, np.full((rows, 4), rank + 1.0, np.float32))
    print("summed")
except ds4t.GateDesync as e:
    print("desync", e.field, e, flush=True)
p.close()
"""


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
@pytest.mark.parametrize("rows1", [3, 4])
def test_torch_ranks_whose_chunks_differ_stop_before_a_gate(tmp_path, rows1):
    """Two gloo ranks, the second's chunk one row longer: both name the rows before any gate
    (an all-gather of unequal sizes aborted both processes inside gloo); equal chunks sum."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    script.write_text(_CHUNK_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(ds4.__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(rows)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r, rows in ((0, 3), (1, rows1))]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    if rows1 == 3:
        assert all(o.strip().endswith("summed") for o in outs), outs
    else:
        for o in outs:
            assert "desync rows" in o and "chunk has rows" in o, outs


@pytest.mark.parametrize("word, field, got, want", [
    (2, "p0", "p0 2147483652", "expected 4"),  # (the high half of a position over 31 bits)
    (3, "rows", "rows 3", "expected 2"),
    (4, "logits", "logits 0", "expected 1"),
    (5, "seq", "seq 10", "expected 9"),
    (6, "seq", "seq 2147483657", "expected 9"),
])
def test_a_torch_chunk_record_names_the_field_that_differs(word, field, got, want):
    """The chunk record's words as TorchPartner._chunk_header writes them, by hand: magic, p0 in
    two halves, rows, logits, seq in two halves, rank."""
    from ds4.tp.partner import CHUNK_MAGIC, check_chunk_header
    from ds4.wire import ds4t

    mine = [CHUNK_MAGIC, 4, 0, 2, 1, 9, 0, 1]  # position 4, 2 rows, logits, seq 9, rank 1
    theirs = list(mine)
    theirs[word] += 1 if word not in (4,) else -1
    check_chunk_header(list(mine), mine, 1)
    with pytest.raises(ds4t.GateDesync, match=f"rank 1's chunk has {got}, {want}") as e:
        check_chunk_header(theirs, mine, 1)
    assert e.value.field == field
