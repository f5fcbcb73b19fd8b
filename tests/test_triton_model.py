"""The whole tiny model on the Triton backend against the reference: logits, greedy tokens,
session state, and handoff of a session between the two backends. Without a GPU the kernels run
under TRITON_INTERPRET=1; the CUDA-graph tests need a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (conftest.py)

import ds4  # noqa: E402
from ds4.backends.triton.plumbing import MM_MIN  # noqa: E402
from ds4.core.tiny import make_tiny  # noqa: E402
from seeds import SEED  # noqa: E402

LOGITS_RTOL = 1e-3
# ds4 numerics round K/V to FP8 and the indexer's queries/keys to FP4, and the indexer keeps a
# discrete top-k: a last-bit difference upstream (summation order) can flip one rounding or one
# selected row, which moves the logits by more than rounding. Exact numerics has none of these
# steps and must match to LOGITS_RTOL; ds4 numerics to DS4_RTOL. What sets the two, measured by
# bench/triton/parity_full.py at the real shapes on the H200 (results_h200/parity/): exact
# numerics stay within 4e-5 everywhere (LOGITS_RTOL keeps a margin for the test model's random
# draws); in ds4 numerics every position where no router or indexer choice flipped stays within
# 2e-3, and each excess is a flip of a near-tie (a reference score margin of 6e-7 to 8e-4; one
# indexer flip of margin 1.5e-5 moved a step's logits to 2.2e-3, and issue #30 saw 1.1e-2 from
# the same kind of step). The fixed ds4 case below may contain such a flip, hence 1e-2.
DS4_RTOL = 1e-2
# the ds4 case's prompt tokens whose ratio-4 compressed rows (4) all fit the indexer's top-4
F16_SELECT_FREE = 16
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs CUDA")


def _rel(a, b):
    assert np.isfinite(a).all()
    return float(np.abs(a - b).max() / np.abs(b).max())


def _same_greedy(got: np.ndarray, want: np.ndarray) -> bool:
    """Same argmax, or a certified near-tie: the reference's top-2 gap is within twice the
    largest logit difference, so the difference alone can swap them."""
    if int(np.argmax(got)) == int(np.argmax(want)):
        return True
    top2 = np.sort(want)[-2:]
    return (top2[1] - top2[0]) <= 2 * np.abs(got - want).max()


# Exact numerics run on a model and prompt drawn from the tests' seed (seeds.py: DS4_TEST_SEED
# draws another). ds4 numerics run on a fixed model and prompt whatever the seed: a free-running
# ds4 session of two float32 implementations drifts apart wherever one FP8/FP4 rounding or
# indexer choice lands on the other side of a boundary (see DS4_RTOL), so another draw could
# fail for that reason alone; the fixed case is deterministic under the interpreter. Its seeds
# are not chosen for a small error: model seed 0, prompt seed 0.
DRAW = np.random.default_rng([SEED, 1])
CASES = {"exact": (int(DRAW.integers(1 << 16)), DRAW), "ds4": (0, np.random.default_rng(0))}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = {}
    for num, (seed, rng) in CASES.items():
        p = tmp_path_factory.mktemp("tm") / f"test-{num}.gguf"
        make_tiny(p, preset="test", seed=seed)
        # 24 tokens: slide the 8-row window, close 6 ratio-4 and 3 ratio-8 windows, overflow the
        # indexer's top-4
        out[num] = (p, [int(x) for x in rng.integers(0, 512, 24)])
    return out


@pytest.fixture(scope="module")
def path(cases):
    return cases["exact"][0]


@pytest.fixture(scope="module")
def prompt(cases):
    return cases["exact"][1]


@pytest.fixture(scope="module")
def engines(cases):
    from ds4.backends.triton.layout import Q8C

    out = {}
    for num, (p, _) in cases.items():
        tri = ds4.Engine.open(p, backend="triton", numerics=num, device=DEVICE)
        if num == "exact":  # its Q8C decode products on x in XQ8 form (decoder 309), the ds4 case's on floats (308)
            tri.backend.mv_types = {**tri.backend.mv_types, Q8C: 309}
            tri.backend.mv_shapes = {}  # (on a GPU the shipped table names the full model's shapes only)
        out[num] = (ds4.Engine.open(p, backend="reference", numerics=num), tri)
    return out


@pytest.mark.parametrize("numerics", ["ds4", "exact"])
def test_logits_and_greedy_tokens_match_reference(engines, cases, numerics):
    ref, tri = engines[numerics]
    prompt = cases[numerics][1]
    rtol = LOGITS_RTOL if numerics == "exact" else DS4_RTOL
    a, b = ref.session(ctx=64), tri.session(ctx=64)
    a.sync(prompt)  # 24 tokens: the matrix-matrix (prefill) kernels
    b.sync(prompt)
    tri.backend.ledger = []
    for _ in range(3 if GPU else 1):  # eager, captured and replayed decode steps on a GPU
        assert _rel(b.logits, a.logits) <= rtol
        assert _same_greedy(b.logits, a.logits)
        t = int(np.argmax(a.logits))
        a.eval(t)
        b.eval(t)
    assert _rel(b.logits, a.logits) <= rtol
    xq8 = [k for k, _ in tri.backend.ledger].count("matvec_xq_kernel")
    tri.backend.ledger = None
    # exact: per layer wq_a, wkv and wo_a (x from the attention's merge) on 309, then the head
    assert xq8 >= 3 * tri.config.n_layer + 1 if numerics == "exact" else xq8 == 0
    if numerics != "exact":
        return  # ds4 rounding flips drift the cache rows apart; their kernels are tested bit-exact
    # the per-layer state agrees too
    for il in a.states:
        for k, want in a.states[il].items():
            got = tri.backend.state_to_numpy(b.states[il], k)
            assert got.dtype == np.float32 and got.shape == want.shape
            fin = np.isfinite(want)
            assert np.array_equal(fin, np.isfinite(got))
            close = np.abs(got[fin] - want[fin]) <= 1e-4 * max(1.0, np.abs(want[fin]).max())
            assert close.mean() > 0.99, (il, k)


# A grouped prefill's chunk: on a GPU ds4's 2048 tokens; in the interpreter the fewest that take
# the matrix-matrix kernels (a shorter chunk is not grouped: TritonBackend.prefill_ffn_min_rows)
GROUP_CHUNK = 2048 if GPU else MM_MIN


@pytest.mark.parametrize("numerics", ["ds4", pytest.param("exact", marks=needs_gpu)])
def test_chunks_sharing_their_ffn_change_no_bit(engines, monkeypatch, numerics):
    """Two prefill chunks whose FFN sublayers run as one (prefill_ffn_rows: graph.forward_chunks,
    the mHC expansions written straight into the shared rows) leave the logits and the state bit
    for bit as the chunks one after another do. The mHC mixing kernel splits its K by the rows it
    gets (a 2048 chunk in 4 parts, 4096 rows in 2), so the FFN collapses a group one chunk at a
    time. On a GPU the chunks are 2048 tokens; the interpreter runs two of the shortest chunks a
    group takes, with the mixing kernel split by its rows as on a GPU, for 16 programs of 2 tokens
    (2 parts for a chunk, 1 for the group's 32 rows)."""
    import ds4.engine as eng
    from ds4.core.graph import forward_chunks
    from ffn_groups import assert_same_bits, prefill_both_ways

    _, tri = engines[numerics]
    if not GPU:
        for name, value in (("hc_mix_bt", (2, 2)), ("hc_mix_split", 2), ("hc_mix_programs", 16),
                            ("hc_mix_step", 256)):
            monkeypatch.setattr(tri.backend, name, value)
    n = 2 * GROUP_CHUNK
    prompt = [int(x) for x in np.random.default_rng([SEED, 2]).integers(0, tri.config.n_vocab, n)]
    calls = []
    monkeypatch.setattr(eng, "forward_chunks", lambda *a, **k: calls.append(a[4]) or forward_chunks(*a, **k))
    out = prefill_both_ways(tri, prompt, max(64, n), GROUP_CHUNK, n, monkeypatch)
    assert calls == [[(0, GROUP_CHUNK), (GROUP_CHUNK, n)]]
    assert_same_bits(out[n], out[0])


def test_session_hands_off_between_backends(engines, cases):
    """A session prefilled on one backend continues on the other with the same greedy tokens
    (state_to_numpy / state_from_numpy are exact float32 copies)."""
    ref, tri = engines["ds4"]
    prompt = cases["ds4"][1]
    s_tri = tri.session(ctx=64)
    s_tri.sync(prompt[:20])
    snap = s_tri.snapshot()
    # the snapshot round-trips exactly
    back = tri.session(ctx=64)
    back.restore(snap)
    for il in snap.arrays:
        for k, v in snap.arrays[il].items():
            assert np.array_equal(tri.backend.state_to_numpy(back.states[il], k), v)
    # triton -> reference: the reference continues from the triton state
    s_ref = ref.session(ctx=64)
    s_ref.restore(snap)
    ahead = tri.session(ctx=64)
    ahead.restore(snap)
    for _ in range(2):
        t = int(np.argmax(s_ref.logits))
        assert _same_greedy(ahead.logits, s_ref.logits)
        s_ref.eval(t)
        ahead.eval(t)
        assert _rel(ahead.logits, s_ref.logits) <= DS4_RTOL
    # reference -> triton
    s_ref2 = ref.session(ctx=64)
    s_ref2.sync(prompt[:21])
    s_tri2 = tri.session(ctx=64)
    s_tri2.restore(s_ref2.snapshot())
    t = int(np.argmax(s_ref2.logits))
    s_ref2.eval(t)
    s_tri2.eval(t)
    assert _rel(s_tri2.logits, s_ref2.logits) <= DS4_RTOL
    assert _same_greedy(s_tri2.logits, s_ref2.logits)


def test_f16_prefill_stays_within_the_ds4_tolerance(engines, cases):
    """The "f16" prefill precision (x, and with q8_f16w the Q8C linears' weights, rounded once to
    fp16 before the products: ds4's own GPU prefill numerics) on the ds4 case: the same greedy
    token as the reference after the whole prompt, and the logits within DS4_RTOL after its
    first F16_SELECT_FREE tokens, where every ratio-4 layer's compressed rows still fit the
    indexer's top-4 (no indexer choice). Past that, the choice follows the rounding of x: a
    change of float32's summation order alone (the moe16 K-step's width, every product exact)
    selects other rows for many of the 24 queries, and whether the logits then stay within
    DS4_RTOL is chance."""
    ref, tri = engines["ds4"]
    prompt = cases["ds4"][1]
    be = tri.backend
    saved, be.prec, be.q8_f16w, be.ledger = (be.prec, be.q8_f16w), "f16", True, []
    try:
        got = []
        for n in (F16_SELECT_FREE, len(prompt)):
            a, b = ref.session(ctx=64), tri.session(ctx=64)
            a.sync(prompt[:n])
            b.sync(prompt[:n])
            got.append((b.logits, a.logits))
    finally:
        be.prec, be.q8_f16w = saved
    ran = {k for k, _ in be.ledger}
    be.ledger = None
    assert {"x16_kernel", "matmul_f16w_kernel"} <= ran, ran
    assert _rel(*got[0]) <= DS4_RTOL
    assert _same_greedy(*got[1])


# ---- GPU only -----------------------------------------------------------------------------------

@needs_gpu
def test_cuda_graph_decode_matches_eager(path, prompt):
    """Decode steps replayed from the captured CUDA graph equal eager steps; a second session
    gets its own graph; a restored session replays correctly."""
    g = ds4.Engine.open(path, backend="triton", device=DEVICE)
    e = ds4.Engine.open(path, backend="triton", cuda_graphs=False, device=DEVICE)
    sg, se = g.session(ctx=64), e.session(ctx=64)
    sg.sync(prompt[:10])
    se.sync(prompt[:10])
    for t in prompt[10:20]:
        sg.eval(t)
        se.eval(t)
        assert _rel(sg.logits, se.logits) <= 1e-5
    assert any(en.graph is not None for en in g.backend._graphs.values())
    other = g.session(ctx=64)
    other.sync(prompt[:5])
    for t in prompt[5:9]:
        other.eval(t)
    snap = sg.snapshot()
    sg.eval(prompt[20])
    se.eval(prompt[20])
    assert _rel(sg.logits, se.logits) <= 1e-5
    sg.restore(snap)
    sg.eval(prompt[21])
    se2 = e.session(ctx=64)
    se2.restore(snap)
    se2.eval(prompt[21])
    assert _rel(sg.logits, se2.logits) <= 1e-5


def _decode_bit_for_bit(x, y, prompt) -> None:
    """The same prompt and 8 decode steps (warm-up, capture, replays) on engines x and y: the
    same logits, bit for bit, after each step; x captured its decode step."""
    a, b = x.session(ctx=64), y.session(ctx=64)
    a.sync(prompt[:12])
    b.sync(prompt[:12])
    for t in prompt[12:20]:
        a.eval(t)
        b.eval(t)
        assert np.array_equal(a.logits, b.logits)
    assert any(en.graph is not None for en in x.backend._graphs.values())


@needs_gpu
def test_side_streams_change_no_bit(path, prompt):
    """Decode steps whose branches ran on side streams (warm-up, capture, replays) give the same
    logits, bit for bit, as the same steps on one stream: the ordering between the streams is
    complete (ds4/backends/triton/lanes.py)."""
    two = ds4.Engine.open(path, backend="triton", device=DEVICE)
    one = ds4.Engine.open(path, backend="triton", device=DEVICE)
    two.backend.lanes = 6  # side streams, whatever the tuning's default
    one.backend.lanes = 0
    _decode_bit_for_bit(two, one, prompt)


@needs_gpu
def test_early_launch_changes_no_bit(path, prompt):
    """Decode steps whose XQ8 products launch before the kernel ahead of them ends (programmatic
    dependent launch, `pdl_xq`) give the same logits, bit for bit, as steps without (warm-up,
    capture, replays): each waits for that kernel before it reads x."""
    from ds4.backends.triton.layout import Q8C

    new = ds4.Engine.open(path, backend="triton", device=DEVICE)
    old = ds4.Engine.open(path, backend="triton", device=DEVICE)
    for en in (new, old):  # (the tiny model's Q8C products on 309, as in `engines`)
        en.backend.mv_types = {**en.backend.mv_types, Q8C: 309}
        en.backend.mv_shapes = {}
    new.backend.pdl_xq = True  # (whatever the tuning's default)
    old.backend.pdl_xq = False
    early = []
    launch = new.backend._launch

    def spy(kern, grid, *args, **kw):
        early.append(bool(kw.get("launch_pdl")))
        return launch(kern, grid, *args, **kw)

    new.backend._launch = spy
    _decode_bit_for_bit(new, old, prompt)
    assert sum(early) >= 3  # (wo_a of each layer, the head: the early launches happened)


@needs_gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "default_sampling"])
def test_sampling_on_the_device_is_sample_and_eval_in_a_loop(path, prompt, temperature):
    """Session.sample with each next token chosen on the device (the argmax, or a draw on ds4's
    default sampling path, min-p 0.05) and the steps replayed back to back: the tokens and rng
    state of sample + eval in a loop on the same engine, and the logits bit for bit, at the end
    of a run, after a stop token, after the caller stops reading and when a run resumes."""
    from ds4.core.sampling import Rng, SamplingParams, sample

    eng = ds4.Engine.open(path, backend="triton", device=DEVICE)
    be = eng.backend
    params = SamplingParams(temperature=temperature)
    launches = []
    launch = be.chain_launch
    be.chain_launch = lambda *a, **kw: launches.append(a) or launch(*a, **kw)

    def loop(s, n, rng, stop=()):
        out = []
        while len(out) < n:
            out.append(sample(s.logits, params, rng))
            s.eval(out[-1])
            if out[-1] in stop:
                break
        return out

    def synced():
        s = eng.session(ctx=64)
        s.sync(prompt[:12])
        return s

    a, b, ra, rb = synced(), synced(), Rng(3), Rng(3)
    got = list(a.sample(14, params, ra))
    assert got == loop(b, 14, rb) and len(launches) == 12  # two evals prepare the step
    assert np.array_equal(a.logits, b.logits) and a.tokens == b.tokens and ra.state == rb.state
    stop = got[9]
    c, d, rc, rd = synced(), synced(), Rng(3), Rng(3)  # (the tokens of `got`, up to the stop)
    assert list(c.sample(14, params, rc, stop={stop})) == loop(d, 14, rd, stop={stop})
    assert np.array_equal(c.logits, d.logits) and c.tokens == d.tokens and rc.state == rd.state
    run = c.sample(10, params, rc)
    head = [next(run) for _ in range(3)]
    run.close()
    assert head == loop(d, 3, rd)
    assert np.array_equal(c.logits, d.logits) and c.tokens == d.tokens and rc.state == rd.state
    assert list(c.sample(5, params, rc)) == loop(d, 5, rd)
    assert np.array_equal(c.logits, d.logits) and rc.state == rd.state
