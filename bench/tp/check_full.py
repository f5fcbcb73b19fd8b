"""Tensor parallel against one rank on the full-size synthetic DS4 Flash (issue #33 point 5).

    python bench/tp/check_full.py bytes                 # CPU: bytes each rank binds (no GPU needed)
    python bench/tp/check_full.py one  --out DIR        # GPU: one triton rank, 64 greedy tokens
    python bench/tp/check_full.py pair --out DIR        # GPU: two triton ranks (worker spawned)
    python bench/tp/check_full.py small --out DIR       # GPU: test preset, triton + reference

The model is the flash preset as a sparse GGUF (`write_sparse_gguf`: the real header and a
hole for the data) run with `synthetic=True`: every rank makes each tensor's bytes from the
tensor's name and cuts its part, so the ranks hold the parts of one model. `one` and `pair` run
in separate processes (one after the other) so the GPU holds one model at a time; both ranks of
`pair` share the one GPU, gates over loopback TCP, with --debug-hash on. Each writes JSON into
--out; `pair` and `small` feed the one-rank run's greedy tokens and compare, step by step, the
logits and their argmax with the one-rank run's (a differing argmax is reported with the one-rank
top-2 gap, so that a near-tie, which a different order of addition can flip, shows as one), and
the router's and the indexer's choices call by call (`choice_flips`: where they differ, which step
and layer).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import ds4
from ds4.core.gguf_model import GGUFModel
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.tiny import preset_config
from ds4.core.tp_split import RankPart, split_of, Split

PROMPT_TOKENS = 100
GEN_TOKENS = 64
SEED = 0
FLASH_GGUF = "/tmp/ds4-flash-sparse.gguf"
SMALL_PRESET = "test"


def flash_gguf(path: str = FLASH_GGUF) -> str:
    if not os.path.exists(path):
        cfg = preset_config("flash")
        write_sparse_gguf(path, cfg, {}, [f"<t{i}>" for i in range(cfg.n_vocab)], [])
    return path


def prompt(n_vocab: int) -> list[int]:
    return np.random.default_rng(SEED).integers(0, n_vocab, PROMPT_TOKENS).tolist()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


class Choices:
    """Records the router's expert ids and the indexer's selected rows of a backend, call by call
    with the step each call belongs to (-1: the prompt). Where two runs see the same history, a
    choice that differs is a near-tie the order of addition flipped, and the logits after it may
    differ by far more than the order of addition alone moves them."""

    def __init__(self, backend, ratio):
        self.step, self.calls = -1, []
        router, select = backend.router, backend.indexer_select

        def host(x):
            return x if isinstance(x, np.ndarray) else backend.to_numpy(x)

        def rec_router(f, gate_inp, bias, tid2eid, tokens, il):
            ids, w = router(f, gate_inp, bias, tid2eid, tokens, il)
            self.calls.append((self.step, "router", il, np.sort(host(ids), axis=1)))
            return ids, w

        def rec_select(st, qr, a, w, p0, il):
            sel = select(st, qr, a, w, p0, il)
            if sel is not None:
                rows = int((p0 + qr.shape[0]) // ratio(il))
                self.calls.append((self.step, "index", il, sel if isinstance(sel, np.ndarray) else sel.mask(rows)))
            return sel

        backend.router, backend.indexer_select = rec_router, rec_select

    @staticmethod
    def flips(want: list, got: list, limit: int = 20) -> dict:
        """Where the two runs' choices differ: the count and the first `limit` (step, kind, layer,
        rows that differ)."""
        out = []
        for (step, kind, il, a), (_, _, _, b) in zip(want, got):
            if a.shape != b.shape or not np.array_equal(a, b):
                rows = int(np.any(a != b, axis=1).sum()) if a.shape == b.shape else -1
                out.append(dict(step=step, kind=kind, layer=il, rows=rows))
        return dict(choice_calls=len(want), choice_flips=len(out), first_choice_flips=out[:limit])


def run(session, ids: list[int], choices: Choices, force: list[int] | None = None, n: int | None = None) -> dict:
    """The prompt, then n greedy steps through Session.eval (the logits of every step kept, and
    the router's and the indexer's choices that `choices` records of the session's backend).
    force: feed these tokens instead of the session's own choices (a second run then sees the
    first run's history at every step, so its logits stay comparable past a near-tie);
    `tokens` are always the session's own argmax choices."""
    n = GEN_TOKENS if n is None else n
    t0 = time.perf_counter()
    session.sync(ids)
    t_prefill = time.perf_counter() - t0
    first = np.array(session.logits, copy=True)
    toks, steps = [], []
    t0 = time.perf_counter()
    for i in range(n):
        toks.append(int(np.argmax(session.logits)))
        choices.step = i
        session.eval(toks[-1] if force is None else int(force[i]))
        steps.append(np.array(session.logits, copy=True))
    t_gen = time.perf_counter() - t0
    return dict(tokens=toks, first=first, last=steps[-1], steps=np.stack(steps),
                prefill_s=t_prefill, decode_tok_s=n / t_gen, choices=choices.calls)


def gpu_gb() -> float:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 1e9


ARRAYS = ("first", "last", "steps", "choices")  # what a run keeps beside its JSON, not in it


def save(out: Path, name: str, r: dict, extra: dict) -> None:
    np.savez(out / f"{name}.npz", tokens=r["tokens"], first=r["first"], last=r["last"], steps=r["steps"])
    (out / f"{name}.choices").write_bytes(pickle.dumps(r["choices"]))
    (out / f"{name}.json").write_text(json.dumps(brief(r) | extra, indent=1))


def brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k not in ARRAYS}


def one_tokens(out: Path, one: str) -> list[int]:
    return [int(t) for t in np.load(out / f"{one}.npz")["tokens"]]


def compare(out: Path, one: str, r: dict) -> dict:
    """r (run with force = the one-rank run's tokens) against the one-rank run, step by step: the
    logits' relative difference, and where the argmax differs whether it is a certified near-tie
    (the one-rank top-2 gap is within twice the largest logit difference, so the difference
    alone can swap them)."""
    ref = np.load(out / f"{one}.npz")
    want = np.concatenate([ref["first"][None], ref["steps"]])
    got = np.concatenate([r["first"][None], r["steps"]])
    flips = []
    for i, (a, b) in enumerate(zip(want, got)):
        if int(np.argmax(a)) != int(np.argmax(b)):
            top2 = np.sort(a)[-2:]
            gap, diff = float(top2[1] - top2[0]), float(np.abs(a - b).max())
            flips.append(dict(step=i, one_top2_gap=gap, max_logit_diff=diff, near_tie=gap <= 2 * diff))
    rels = [rel(a, b) for a, b in zip(want, got)]
    choices = Choices.flips(pickle.loads((out / f"{one}.choices").read_bytes()), r["choices"])
    return dict(tokens_equal=not flips, steps=len(want), flips=flips,
                prompt_logits_rel=rels[0], max_step_logits_rel=max(rels), final_logits_rel=rels[-1],
                step_logits_rel=rels) | choices


def _part_bytes(p: RankPart, t, cfg) -> int:
    if split_of(t.name) == Split.COLS_BY_GROUP:  # (the column cut copies; count, don't read)
        return t.n_bytes // p.n_rank
    return p.slice(t, cfg).n_bytes


def cmd_bytes(a) -> None:
    """Bytes bound by one rank and by each of two ranks, from the flash layout's tensors."""
    model = GGUFModel(flash_gguf())
    cfg = model.config
    parts = [RankPart.of(cfg, 2, r) for r in range(2)]
    rows = {"one": 0, "rank0": 0, "rank1": 0, "routed_experts": 0}
    for name, t in model.tensors.items():
        rows["one"] += t.n_bytes
        if split_of(name) == Split.EXPERTS:
            rows["routed_experts"] += t.n_bytes
        for r, p in enumerate(parts):
            if p.holds(name):
                rows[f"rank{r}"] += _part_bytes(p, t, cfg)
    rows = {k: v / 1e9 for k, v in rows.items()}
    rows["routed_share"] = rows["routed_experts"] / rows["one"]
    print(json.dumps(rows, indent=1))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bytes.json").write_text(json.dumps(rows, indent=1))


def cmd_one(a) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    eng = ds4.Engine.open(flash_gguf(), backend="triton", numerics=a.numerics, synthetic=True,
                          cuda_graphs=False)
    gb = gpu_gb()
    r = run(eng.session(ctx=1024), prompt(eng.config.n_vocab), Choices(eng.backend, eng.config.ratio))
    save(out, f"one-{a.numerics}", r, dict(gpu_gb=gb))
    print(json.dumps(brief(r) | {"gpu_gb": gb}))


def cmd_worker(a) -> None:
    from ds4.tp import Options, TPWorker

    host, port = a.leader.rsplit(":", 1)
    gguf = flash_gguf() if a.model is None else a.model
    opts = dict(synthetic=True) if a.model is None else {}
    w = TPWorker.open(gguf, (host, int(port)), backend=a.backend, numerics=a.numerics,
                      opts=Options(gate_timeout_ms=600_000, io_timeout=600), **opts)
    print(json.dumps({"worker_gpu_gb": gpu_gb() if a.backend == "triton" else 0.0}), flush=True)
    w.serve()


def _pair(out: Path, gguf: str, backends: tuple[str, str], numerics: str, synthetic: bool, force: list[int]):
    from ds4.tp import Options, TPEngine

    opts = dict(synthetic=True) if synthetic else {}
    lead = TPEngine.open(gguf, ("127.0.0.1", 0), backend=backends[0], numerics=numerics, ctx=1024,
                         opts=Options(debug_hash=True, gate_timeout_ms=600_000, io_timeout=600),
                         connect=False, **opts)
    gb = gpu_gb() if backends[0] == "triton" else 0.0
    cmd = [sys.executable, __file__, "worker", "--leader", f"127.0.0.1:{lead.address[1]}",
           "--backend", backends[1], "--numerics", numerics]
    if not synthetic:
        cmd += ["--model", gguf]
    worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lead.ensure_worker()
    worker_gb = json.loads(worker.stdout.readline())["worker_gpu_gb"]
    r = run(lead.session(ctx=1024), prompt(lead.config.n_vocab), Choices(lead.backend, lead.config.ratio),
            force=force)
    lead.close()
    worker.wait(timeout=600)
    return r, dict(leader_gpu_gb=gb, worker_gpu_gb=worker_gb, backends="+".join(backends))


def cmd_pair(a) -> None:
    out = Path(a.out)
    one = f"one-{a.numerics}"
    r, extra = _pair(out, flash_gguf(), ("triton", "triton"), a.numerics, True, one_tokens(out, one))
    extra |= compare(out, one, r)
    save(out, f"pair-{a.numerics}", r, extra)
    print(json.dumps(brief(r) | extra))


def cmd_small(a) -> None:
    from ds4.core.tiny import make_tiny

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = str(out / "small.gguf")
    make_tiny(gguf, preset=SMALL_PRESET, seed=SEED)
    one = ds4.Engine.open(gguf, backend="reference", numerics=a.numerics)
    name = f"small-one-{a.numerics}"
    save(out, name, run(one.session(ctx=1024), prompt(one.config.n_vocab), Choices(one.backend, one.config.ratio)), {})
    r, extra = _pair(out, gguf, tuple(a.backends.split(",")), a.numerics, False, one_tokens(out, name))
    extra |= compare(out, name, r)
    save(out, f"small-pair-{a.numerics}", r, extra)
    print(json.dumps(brief(r) | extra))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["bytes", "one", "pair", "small", "worker"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--numerics", default="exact", choices=["exact", "ds4"])
    ap.add_argument("--leader", default=None)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--model", default=None)
    ap.add_argument("--backends", default="triton,reference", help="small: leader,worker backends")
    a = ap.parse_args()
    {"bytes": cmd_bytes, "one": cmd_one, "pair": cmd_pair, "small": cmd_small, "worker": cmd_worker}[a.what](a)


if __name__ == "__main__":
    main()
