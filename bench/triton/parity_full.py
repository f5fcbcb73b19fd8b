"""Triton against the reference on a DS4 model of real Flash shapes, layer by layer and position
by position, with the router's and the indexer's choices compared.

Writes a DS4 GGUF with the flash preset's sizes (n_embd 4096, 64 heads of 512, the real
vocabulary, 256 experts of 2048, the indexer's 64 heads of 128 and top-512) and a few layers:
sliding with hash routing, CSA (ratio 4, indexer) and HCA (ratio 128) with top-k routing. Each
prompt is prefilled on both backends, then decoded greedily (the reference's token) for
--steps steps, in each numerics mode. Reported, per numerics, prompt and step:

* the logits' relative error (max |Δ| / max |reference|) where logits exist (the prompt's end and
  every decode step), and for every position and layer the relative error of the layer's output
  (the mHC state after its FFN sublayer);
* per layer and position, whether the router's expert set and the indexer's selected rows agree,
  and where they do not, the reference's score margin at the boundary (the last chosen against
  the first left out; a tiny margin means a near-tie that float32 summation order can flip).

A position is "clean" when neither choice flipped at or before it in any layer: the errors
there must stay within the tolerance of tests/test_triton_model.py. Everything goes to
parity.csv / parity.json under --out, with the device named.

    PYTHONPATH=. python bench/triton/parity_full.py --out results_h200/parity [--experts q2]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

import ds4
from ds4.core.atomic import atomic_file
from ds4.core.tiny import EXPERT_MIXES, make_synthetic, preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (run as a script or imported by path)
from settings import apply_settings  # noqa: E402

CLEAN_RTOL = 2e-3  # what a position without a router or indexer flip must meet (issue #30)


class Recorder:
    """Wraps a backend's router, indexer selection and FFN-side mHC expand, keeping what each
    returned per layer (in call order) as host arrays."""

    def __init__(self, eng, reference: bool):
        self.be = be = eng.backend
        self.calls = defaultdict(list)  # kind -> [(layer, p0, value, extra)]
        self.layer = None
        self.p0 = 0
        router, select, hc_post, hc_pre = be.router, be.indexer_select, be.hc_post, be.hc_pre

        def rec_hc_pre(X, hc):
            # the layer a sublayer belongs to, from its weights' object identity
            self.layer, self.sub = self.hc_layer.get(id(hc), (None, None))
            return hc_pre(X, hc)

        def rec_router(f, gate_inp, bias, tid2eid, tokens, il):
            ids, w = router(f, gate_inp, bias, tid2eid, tokens, il)
            extra = be.router_scores(f, gate_inp, bias)[1] if reference and tid2eid is None else None
            self.calls["router"].append((il, self.p0, np.asarray(ids if reference else be.to_numpy(ids)), extra))
            return ids, w

        def rec_select(st, qr, a, w, p0, il):
            sel = select(st, qr, a, w, p0, il)
            if sel is not None:
                mask = sel if reference else sel.mask(int((p0 + qr.shape[0]) // eng.config.ratio(il)))
                scores = be.indexer_scores(st, qr, a, w, p0, il) if reference else None
                self.calls["index"].append((il, p0, np.asarray(mask), scores))
            return sel

        def rec_hc_post(y, X, post, comb):
            out = hc_post(y, X, post, comb)
            if self.sub == "ffn":
                self.calls["layer_out"].append((self.layer, self.p0, np.asarray(out if reference else be.to_numpy(out)),
                                                None))
            return out

        self.hc_layer = {}
        for il, L in eng.weights.layers.items():
            self.hc_layer[id(L.hc_attn)] = (il, "attn")
            self.hc_layer[id(L.hc_ffn)] = (il, "ffn")
        self.sub = None
        be.router, be.indexer_select, be.hc_post, be.hc_pre = rec_router, rec_select, rec_hc_post, rec_hc_pre
        begin = be.begin_chunk

        def rec_begin(states, tokens, p0, logits):
            self.p0 = p0
            return begin(states, tokens, p0, logits)

        be.begin_chunk = rec_begin

    def take(self):
        out, self.calls = self.calls, defaultdict(list)
        return out


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def compare_calls(ref: dict, tri: dict, k_used: int, top_k: int, rows: list, tag: dict) -> dict:
    """Per (layer, position): layer-output error, router / indexer agreement and margins."""
    flips = defaultdict(list)  # position -> [(kind, layer, margin)]
    for (il, p0, want, scores), (_, _, got, _) in zip(ref["router"], tri["router"]):
        for i in range(want.shape[0]):
            a, b = set(want[i].tolist()), set(got[i].tolist())
            if a != b:
                margin = float("nan")
                if scores is not None:
                    s = np.sort(scores[i])[::-1]
                    margin = float(s[k_used - 1] - s[k_used])
                flips[p0 + i].append(("router", il, margin))
    for (il, p0, want, scores), (_, _, got, _) in zip(ref["index"], tri["index"]):
        for i in range(want.shape[0]):
            w, g = want[i], got[i][: want.shape[1]]
            if not np.array_equal(w, g):
                s = np.sort(scores[i])[::-1]
                flips[p0 + i].append(("index", il, float(s[top_k - 1] - s[top_k]) if s.size > top_k else float("nan")))
    first_flip = min(flips) if flips else None
    worst_clean = 0.0
    for (il, p0, want, _), (_, _, got, _) in zip(ref["layer_out"], tri["layer_out"]):
        for i in range(want.shape[0]):
            pos = p0 + i
            err = _rel(got[i], want[i])
            clean = first_flip is None or pos < first_flip
            if clean:
                worst_clean = max(worst_clean, err)
            rows.append({**tag, "layer": il, "position": pos, "layer_out_rel": err, "clean": clean,
                         "flips": ";".join(f"{k}@{l}:{m:.3g}" for k, l, m in flips.get(pos, []))})
    return {"flips": {int(p): v for p, v in sorted(flips.items())}, "first_flip": first_flip,
            "worst_clean_layer_out": worst_clean}


def write_results(out: str, summary: dict, rows: list) -> None:
    with atomic_file(os.path.join(out, "parity.json"), "w", private=False) as f:
        json.dump(summary, f, indent=1, default=str)
    with atomic_file(os.path.join(out, "parity.csv"), "w", private=False) as f:
        w = csv.DictWriter(f, fieldnames=["numerics", "prompt", "step", "layer", "position", "layer_out_rel",
                                          "clean", "flips"])
        w.writeheader()
        w.writerows(rows)


def write_model(path: str, cfg, types: dict, seed: int, reuse: bool) -> bool:
    """Write the synthetic GGUF (make_synthetic), with a record of what it holds beside it
    (path + ".json"); reuse: keep a file whose record is the same instead (the same arguments give
    a byte-identical file, and the writing is most of a short check's time). Whether it wrote."""
    record = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()},
              "types": {k: int(v) for k, v in sorted(types.items())}, "seed": seed}
    side = path + ".json"
    if reuse and os.path.exists(path) and os.path.exists(side):
        with open(side) as f:
            if json.load(f) == record:
                return False
    if os.path.exists(side):
        os.remove(side)  # (a record never outlives the file it describes)
    make_synthetic(path, cfg, types, seed=seed)
    with atomic_file(side, "w", private=False) as f:
        json.dump(record, f)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default="/tmp/ds4-parity.gguf")
    ap.add_argument("--reuse-gguf", action="store_true",
                    help="keep --gguf if an earlier run wrote it with the same model arguments")
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--ratios", default="0,4,128", help="compress ratio of each layer")
    ap.add_argument("--hash-layers", type=int, default=1)
    ap.add_argument("--experts", default="q2", choices=sorted(EXPERT_MIXES))
    ap.add_argument("--n-expert", type=int, default=None, help="default: the preset's")
    ap.add_argument("--prompts", default="130,257,300,2100",
                    help="prompt lengths: below/above the window, (non-)multiples of 4 and 128, "
                         "past the indexer's top-k")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--numerics", default="ds4,exact")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-gb", type=float, default=48.0,
                    help="the reference's cache of decoded matrices, shared by both numerics modes")
    ap.add_argument("--set", default="{}",
                    help='JSON {Triton backend attribute: value} set after loading (a tuning field under test, '
                         'e.g. {"f16_x2": false})')
    args = ap.parse_args(argv)
    settings = json.loads(args.set)

    ratios = tuple(int(r) for r in args.ratios.split(","))
    base = preset_config(args.preset)
    kw = dict(n_layer=len(ratios), compress_ratios=ratios, n_hash_layer=args.hash_layers,
              swiglu_clamp=(10.0,) * len(ratios), name=f"ds4-parity-{args.preset}-{args.experts}")
    if args.n_expert:
        kw["n_expert"] = args.n_expert
    cfg = dataclasses.replace(base, **kw)
    cfg.validate()
    t0 = time.time()
    gate_type, down_type = EXPERT_MIXES[args.experts]
    types = {"ffn_gate_exps.weight": gate_type, "ffn_up_exps.weight": gate_type, "ffn_down_exps.weight": down_type}
    wrote = write_model(args.gguf, cfg, types, args.seed, args.reuse_gguf)
    print(f"{'wrote' if wrote else 'kept'} {args.gguf} ({os.path.getsize(args.gguf) / 2**30:.1f} GiB) in "
          f"{time.time() - t0:.0f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    prompts = [int(x) for x in args.prompts.split(",")]
    ctx = max(prompts) + args.steps + 1
    rng = np.random.default_rng(args.seed)
    rows, summary = [], {"config": {k: (list(v) if isinstance(v, tuple) else v)
                                    for k, v in dataclasses.asdict(cfg).items()},
                         "experts": args.experts, "runs": []}
    cache = None
    for numerics in args.numerics.split(","):
        ref = ds4.Engine.open(args.gguf, backend="reference", numerics=numerics,
                              cache_bytes=int(args.cache_gb * 2**30))
        if cache is not None:  # decoded weights do not depend on the numerics mode
            ref.backend._cache, ref.backend._cached = cache
        tri = ds4.Engine.open(args.gguf, backend="triton", numerics=numerics, device=args.device,
                              cuda_graphs=False)
        apply_settings(tri.backend, settings, "--set")
        summary["device"] = tri.backend.device
        summary["set"] = settings
        rr, tr = Recorder(ref, True), Recorder(tri, False)
        for n in prompts:
            prompt = [int(t) for t in rng.integers(0, cfg.n_vocab, n)]
            a, b = ref.session(ctx=ctx), tri.session(ctx=ctx)
            t0 = time.time()
            a.sync(prompt)
            b.sync(prompt)
            run = {"numerics": numerics, "prompt": n, "logits_rel": [_rel(b.logits, a.logits)]}
            tag = {"numerics": numerics, "prompt": n}
            res = compare_calls(rr.take(), tr.take(), cfg.n_expert_used, cfg.indexer_top_k, rows, tag)
            run["prefill"] = res
            for step in range(args.steps):
                t = int(np.argmax(a.logits))
                a.eval(t)
                b.eval(t)
                run["logits_rel"].append(_rel(b.logits, a.logits))
                step_res = compare_calls(rr.take(), tr.take(), cfg.n_expert_used, cfg.indexer_top_k, rows,
                                         {**tag, "step": step})
                run.setdefault("step_flips", []).append(step_res["flips"])
            print(f"{numerics} prompt {n}: logits rel {max(run['logits_rel']):.2e} (prompt end "
                  f"{run['logits_rel'][0]:.2e}), first flip at {res['first_flip']}, worst clean layer "
                  f"output {res['worst_clean_layer_out']:.2e}, {time.time() - t0:.0f} s", flush=True)
            summary["runs"].append(run)
            write_results(args.out, summary, rows)  # (after each prompt: a long run leaves what it did)
        cache = (ref.backend._cache, ref.backend._cached)
    write_results(args.out, summary, rows)
    bad = [r for r in rows if r["clean"] and r["layer_out_rel"] > CLEAN_RTOL]
    print(f"{len(rows)} (layer, position) rows, {len(bad)} clean ones over {CLEAN_RTOL}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
