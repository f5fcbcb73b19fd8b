"""Sessions on the reference backend: chunked prefill ≡ one-shot ≡ decode, prefix reuse, rewind,
errors, and weights that stay quantized."""

from __future__ import annotations

import numpy as np
import pytest

import ds4
from ds4.backends.reference.backend import ReferenceBackend
from ds4.core.graph import chunk_bounds, chunk_groups, forward_chunk, forward_chunks
from ds4.core.gguf_model import GGUFModel
from ds4.core.quants import dequantize_rows
from ds4.core.sampling import GREEDY, Rng, SamplingParams, sample, unsorted_path
from ds4.core.tiny import make_tiny
from ds4.core.weights import bind_weights

PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, 512, 48)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("e") / "test.gguf"
    make_tiny(path, preset="test", seed=1)
    return path


@pytest.fixture(scope="module", params=["ds4", "exact"])
def engine(request, model_path):
    return ds4.Engine.open(model_path, numerics=request.param)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_prompt_exercises_every_mechanism(engine):
    """48 tokens slide the 8-row raw window, close 12 ratio-4 and 6 ratio-8 windows, and give
    the indexer (top-k 4) more rows than it may keep."""
    cfg = engine.config
    assert len(PROMPT) > 2 * cfg.sliding_window
    assert len(PROMPT) // 4 > 2 * cfg.indexer_top_k and len(PROMPT) // 8 >= 3


def test_one_shot_chunked_and_decode_agree(engine):
    one = engine.session(ctx=128)
    one.sync(PROMPT)
    for cap in (5, 16):  # chunk edges inside and on compressor windows
        chunked = engine.session(ctx=128, prefill_cap=cap)
        chunked.sync(PROMPT)
        assert _rel(chunked.logits, one.logits) <= 1e-5
    step = engine.session(ctx=128)
    step.sync(PROMPT[:1])
    for t in PROMPT[1:]:
        step.eval(t)
    assert _rel(step.logits, one.logits) <= 1e-5
    assert step.tokens == PROMPT


@pytest.mark.parametrize("cap, rows", [(5, 48), (16, 32), (16, 48)])
def test_chunks_sharing_their_ffn_compute_each_chunk_alone(engine, monkeypatch, cap, rows):
    """A prompt's chunks whose FFN sublayers run together (prefill_ffn_rows: attention chunk by
    chunk at each layer, then one FFN over the group) leave the logits and every state row bit
    for bit as the chunks run one after another: the reordering changes no sum."""
    import ds4.engine as eng
    from ffn_groups import assert_same_bits, prefill_both_ways

    groups = []
    monkeypatch.setattr(eng, "forward_chunks", lambda *a, **k: groups.append(a[4]) or forward_chunks(*a, **k))
    out = prefill_both_ways(engine, PROMPT, 128, cap, rows, monkeypatch)
    assert groups == [g for g in chunk_groups(chunk_bounds(0, len(PROMPT), cap), rows) if len(g) > 1]
    assert groups  # (none while chunk by chunk)
    assert_same_bits(out[rows], out[0])
    shared, alone = out[rows][2], out[0][2]
    shared.eval(3)  # a decode step after it: one chunk of one token
    alone.eval(3)
    assert np.array_equal(shared.logits, alone.logits)


def test_chunk_groups_gather_whole_chunks_up_to_the_rows():
    bounds = [(3, 5), (5, 10), (10, 15), (15, 20), (20, 22)]
    assert chunk_groups(bounds, 0) == [[b] for b in bounds]
    assert chunk_groups(bounds, 4) == [[b] for b in bounds]  # a chunk past the rows stays alone
    assert chunk_groups(bounds, 10) == [[(3, 5), (5, 10)], [(10, 15), (15, 20)], [(20, 22)]]
    assert chunk_groups(bounds, 19) == [bounds]
    assert chunk_groups([], 8) == []
    # a chunk under min_rows stays alone, and the next chunk does not join it
    assert chunk_groups(bounds, 19, 3) == [[(3, 5)], [(5, 10), (10, 15), (15, 20)], [(20, 22)]]
    assert chunk_groups(bounds, 19, 6) == [[b] for b in bounds]


def test_a_backend_keeps_its_short_chunks_out_of_groups(engine, monkeypatch):
    """Session groups only chunks of at least the backend's prefill_ffn_min_rows tokens."""
    import ds4.engine as eng

    groups = []
    monkeypatch.setattr(eng, "forward_chunks", lambda *a, **k: groups.append(a[4]) or forward_chunks(*a, **k))
    monkeypatch.setattr(engine.backend, "prefill_ffn_rows", 64)
    monkeypatch.setattr(engine.backend, "prefill_ffn_min_rows", 16)
    s = engine.session(ctx=128, prefill_cap=16)
    tokens = PROMPT + PROMPT[:5]
    s.sync(tokens[:5])
    s.sync(tokens)  # chunks [5, 16) alone, [16, 32) with [32, 48), [48, 53) alone
    assert groups == [[(16, 32), (32, 48)]]


def test_forward_chunks_refuses_chunks_that_do_not_follow_each_other(engine):
    s = engine.session(ctx=128)
    with pytest.raises(ValueError, match="not consecutive chunks"):
        forward_chunks(engine.backend, engine.weights, s.states, np.arange(10), [(0, 4), (5, 10)])


def test_sync_reuses_prefix_and_rewinds(engine):
    ref = engine.session(ctx=128)
    ref.sync(PROMPT[:30])
    s = engine.session(ctx=128)
    s.sync(PROMPT)
    s.rewind(30)
    assert s.tokens == PROMPT[:30]
    assert _rel(s.logits, ref.logits) <= 1e-5
    s.sync(PROMPT[:30] + [5, 6, 7])  # extends the held prefix
    ref.eval(5), ref.eval(6), ref.eval(7)
    assert _rel(s.logits, ref.logits) <= 1e-5
    s.sync(PROMPT[:10] + [1, 2])  # diverges inside the held prefix
    fresh = engine.session(ctx=128)
    fresh.sync(PROMPT[:10] + [1, 2])
    assert _rel(s.logits, fresh.logits) <= 1e-5


def test_greedy_generation_is_deterministic(engine):
    out = []
    for _ in range(2):
        s = engine.session(ctx=128)
        s.sync(PROMPT[:12])
        toks = []
        for _ in range(8):
            toks.append(int(np.argmax(s.logits)))
            s.eval(toks[-1])
        out.append(toks)
    assert out[0] == out[1]


def test_bad_input_is_rejected_clearly(engine):
    s = engine.session(ctx=16)
    with pytest.raises(ValueError, match=r"tokens\[1\]: expected an id in \[0, 512\), got 512"):
        s.sync([1, 512])
    with pytest.raises(ValueError, match="do not fit the session's ctx=16"):
        s.sync(list(range(17)))
    with pytest.raises(RuntimeError, match="no logits yet"):
        _ = s.logits
    with pytest.raises(ValueError, match="ctx: expected at least 2"):
        engine.session(ctx=1)
    with pytest.raises(ValueError, match="backend: expected one of"):
        ds4.Engine.open(engine.model.path, backend="nope")
    with pytest.raises(ValueError, match="numerics: expected 'ds4' or 'exact'"):
        ds4.Engine.open(engine.model.path, numerics="fast")


def test_embedding_row_matches_gguf_py(engine):
    """The first op reads the F16 embedding straight from the mapped file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    t = engine.model.tensor("token_embd.weight")
    X = engine.backend.embed(t, np.array([3, 17]))
    want = dequantize(t.rows()[[3, 17]], GGMLQuantizationType.F16)
    assert X.shape == (2, engine.config.n_hc, engine.config.n_embd)
    assert np.array_equal(X[:, 2], want)


def test_weights_stay_quantized(model_path):
    """Every bound weight is a view into the mapped file; the decode cache is bounded."""
    eng = ds4.Engine.open(model_path, cache_bytes=1 << 20)
    s = eng.session(ctx=64)
    s.sync(PROMPT[:20])
    for layer in eng.weights.layers.values():
        for w in (layer.attn_q_a, layer.ffn_gate_exps, layer.ffn_down_exps):
            base = w.raw
            while base is not None and not isinstance(base, np.memmap):
                base = base.base
            assert base is not None, f"{w.name} is not a view of the mapped file"
    assert eng.backend._cached <= 1 << 20
    # the decode of one weight equals gguf-py's
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = eng.model.tensor("blk.3.ffn_down_exps.weight")
    ours = dequantize_rows(w.expert(5), w.type, w.dims[0])
    theirs = dequantize(w.expert(5), GGMLQuantizationType(int(w.type)))
    assert np.array_equal(ours, theirs)


def test_resident_memory_is_about_the_file_size(tmp_path):
    """Running the tiny model (real 129k vocabulary) keeps RSS near the GGUF's size, far below
    its float32 size."""
    path = tmp_path / "tiny.gguf"
    make_tiny(path, preset="tiny", seed=0)

    def rss():
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS"))

    m = GGUFModel(path)
    f32_bytes = sum(4 * int(np.prod(t.dims)) for t in m.tensors.values())
    before = rss()
    eng = ds4.Engine.open(path, cache_bytes=32 << 20)
    s = eng.session(ctx=64)
    s.sync(eng.tokenizer.encode_rendered("Hello there, how are you?"))
    s.eval(int(np.argmax(s.logits)))
    grown = rss() - before
    assert grown < 1.15 * path.stat().st_size + (32 << 20), (grown >> 20, path.stat().st_size >> 20)
    assert grown < f32_bytes / 2


def test_snapshot_restore_continues_identically(engine):
    s = engine.session(ctx=128)
    s.sync(PROMPT[:20])
    snap = s.snapshot()
    s.sync(PROMPT)  # extend, then go back to the snapshot
    s.restore(snap)
    assert s.tokens == PROMPT[:20]
    s.sync(PROMPT[:20] + [9, 8])
    ref = engine.session(ctx=128)
    ref.sync(PROMPT[:20] + [9, 8])
    assert np.array_equal(s.logits, ref.logits)
    with pytest.raises(ValueError, match="snapshot: expected a session layout"):
        engine.session(ctx=64).restore(snap)


def test_output_argmax_is_the_argmax_of_each_rows_logits(engine, monkeypatch):
    """The batched greedy head (a pipeline's last stage) equals the per-row head's argmax,
    also when the head is decoded in several row blocks."""
    import ds4.backends.reference.backend as ref

    monkeypatch.setattr(ref, "HEAD_BLOCK_ROWS", 100)
    be, w = engine.backend, engine.weights
    X = np.random.default_rng(0).standard_normal((5, engine.config.n_hc, engine.config.n_embd))
    X = X.astype(np.float32)
    want = [int(np.argmax(be.output_logits(X[i:i + 1], w.output_hc, w.output_norm, w.output)))
            for i in range(5)]
    got = be.output_argmax(X, w.output_hc, w.output_norm, w.output)
    assert list(got) == want


# ---- Session.greedy / Session.sample -----------------------------------------------------------

def _eval_loop(session, n: int, stop=(), params=GREEDY, rng=None) -> list[int]:
    """What Session.sample promises: sample + eval in a loop, a stop token evaluated too."""
    out = []
    while len(out) < n and len(session.tokens) < session.ctx:
        t = sample(session.logits, params, rng)
        session.eval(t)
        out.append(t)
        if t in stop:
            break
    return out


def _same_session(a, b) -> None:
    assert a.tokens == b.tokens
    assert np.array_equal(a.logits, b.logits)
    sa, sb = a.snapshot(), b.snapshot()
    for il in sa.arrays:
        for name in sa.arrays[il]:
            assert np.array_equal(sa.arrays[il][name], sb.arrays[il][name]), (il, name)


class _Uniform:
    def __init__(self, u):
        self.u = u

    def uniform(self):
        return self.u


class _DeviceChain(ReferenceBackend):
    """The reference backend with chain_launch / chain_token as a device runs them: a launch
    evaluates the token the previous launch chose before anyone has read it, and a ticket is
    read later. Ready, like the Triton backend, from a session's third decode step on, for
    greedy and ds4's default sampling path."""

    def __init__(self, cfg, numerics="ds4"):
        super().__init__(cfg, numerics=numerics)
        self.weights = None
        self.decodes: dict[int, int] = {}
        self.chosen: list[int] = []  # the token each launch chose, by ticket
        self.logits = None
        self.launches = 0
        self.poison_at = None  # ticket whose logits are all NaN

    def begin_chunk(self, states, tokens, p0, logits):
        if len(tokens) == 1 and logits:
            self.decodes[id(states)] = self.decodes.get(id(states), 0) + 1

    def chains(self, states, params):
        return self.decodes.get(id(states), 0) >= 2 and unsorted_path(params) is not None

    def chain_launch(self, states, p0, token=None, draw=None):
        token = self.chosen[-1] if token is None else token
        assert 0 <= token < self.cfg.n_vocab  # a device would read this embedding row
        out = self.to_numpy(forward_chunk(self, self.weights, states, np.array([token]), p0, logits=True))
        self.launches += 1
        if len(self.chosen) == self.poison_at:
            out = np.full_like(out, np.nan)
        self.logits = np.asarray(out, np.float32)
        if not np.isfinite(self.logits).any():
            self.chosen.append(0)
        elif draw is None:
            self.chosen.append(sample(self.logits, GREEDY, None))
        else:
            t, min_p, u = draw
            self.chosen.append(sample(self.logits, SamplingParams(temperature=t, min_p=min_p), _Uniform(u)))
        return len(self.chosen) - 1

    def chain_token(self, ticket):
        if ticket == self.poison_at:
            raise ValueError("cannot choose a token: no finite logit")
        return self.chosen[ticket]

    def chain_logits(self, states):
        return self.logits


@pytest.fixture
def device_engine(model_path, engine):
    model = GGUFModel(model_path)
    be = _DeviceChain(model.config, numerics=engine.numerics)
    eng = ds4.Engine(model, be, bind_weights(model, be.upload), range(model.config.n_layer))
    be.weights = eng.weights
    return eng


def _synced(eng):
    s = eng.session(ctx=64)
    s.sync(PROMPT[:20])
    return s


def test_greedy_is_eval_of_the_argmax_in_a_loop(engine):
    a, b = engine.session(ctx=64), engine.session(ctx=64)
    a.sync(PROMPT[:20])
    b.sync(PROMPT[:20])
    assert list(a.greedy(6)) == _eval_loop(b, 6)
    _same_session(a, b)
    short = engine.session(ctx=24)  # room for 4 only
    short.sync(PROMPT[:20])
    assert len(list(short.greedy(10))) == 4 and len(short.tokens) == 24
    assert list(short.greedy(3)) == []
    with pytest.raises(ValueError, match="rng"):
        next(a.sample(3, SamplingParams()))


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(), SamplingParams(temperature=0.7, min_p=0.0)],
                         ids=["greedy", "default", "t0.7"])
def test_sampling_chained_on_a_device_is_sample_and_eval_in_a_loop(engine, device_engine, params):
    """The back-to-back path (a step queued before the host reads its token) holds the same
    tokens, state, logits and rng state as sample + eval in a loop: to the end, at a stop token
    (evaluated), and when the caller stops reading."""
    be, ref = device_engine.backend, engine
    full = _eval_loop(_synced(ref), 12, params=params, rng=Rng(5))
    stop = full[7]
    a, ra = _synced(device_engine), Rng(5)
    got = list(a.sample(12, params, ra, stop={stop}))
    b, rb = _synced(ref), Rng(5)
    assert got == _eval_loop(b, 12, stop={stop}, params=params, rng=rb) == full[:full.index(stop) + 1]
    assert be.launches == len(got) - 2  # two evals prepare the step, then only launches
    _same_session(a, b)
    assert ra.state == rb.state

    c, rc = _synced(device_engine), Rng(9)
    run = c.sample(12, params, rc)
    head = [next(run) for _ in range(5)]
    run.close()
    d, rd = _synced(ref), Rng(9)
    assert head == _eval_loop(d, 5, params=params, rng=rd)
    _same_session(c, d)
    assert rc.state == rd.state
    assert list(c.sample(4, params, rc)) == _eval_loop(d, 4, params=params, rng=rd)  # and on from there
    _same_session(c, d)
    assert rc.state == rd.state


def test_greedy_without_a_finite_logit_clears_the_session(device_engine):
    be = device_engine.backend
    s = _synced(device_engine)
    run = s.greedy(12)
    for _ in range(4):
        next(run)
    be.poison_at = len(be.chosen) - 1  # the step in flight has chosen from NaN logits
    with pytest.raises(ValueError, match="finite"):
        next(run)
    assert s.tokens == []
