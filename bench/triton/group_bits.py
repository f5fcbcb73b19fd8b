"""FFN groups against chunk by chunk, bit for bit, on the full-size synthetic DS4 Flash.

A prompt of several prefill chunks runs its chunks' FFN sublayers together where the backend's
`prefill_ffn_rows` allows it (`graph.forward_chunks`), so that each routed expert gets fuller
tiles. That must not change a bit: every kernel of a group's FFN must sum each chunk's rows as
the chunk alone does. `tests/test_triton_model.py` asks for it on the tiny model; this checks it
at the real shapes, where tiles, splits and row counts are the ones a user's prompt gets. Each
prompt is prefilled both ways in one process; the logits and every layer's state (raw ring,
compressed rows, indexer rows, compressor frontiers) are compared bit for bit. Writes
group_bits.json under --out, with the device named, and exits 1 if anything differs.

    PYTHONPATH=. python bench/triton/group_bits.py --out results/ [--layers 30] [--prompts 8192,3048]

A prompt of 3048 tokens puts a 1000-token tail chunk into a group with a full one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

import ds4
from ds4.core.atomic import atomic_file
from ds4.core.gguf_write import write_sparse_gguf
from ds4.core.tiny import preset_config


def prefill(eng, prompt: list[int], cap: int, rows: int):
    """(logits, {layer: {state name: numpy}}) of `prompt` prefilled with prefill_ffn_rows = rows."""
    be = eng.backend
    be.prefill_ffn_rows = rows
    s = eng.session(ctx=len(prompt) + 16, prefill_cap=cap)
    s.sync(prompt)
    torch.cuda.synchronize()
    states = {il: {k: be.state_to_numpy(st, k) for k in st} for il, st in s.states.items()}
    return s.logits.copy(), states


def compare(alone, grouped) -> dict:
    """Where the grouped prefill differs from chunk by chunk: the logits' largest relative
    difference and the first (layer, state name) whose rows differ (None: every bit equal)."""
    la, lg = alone[0], grouped[0]
    first = next((f"{il}:{k}" for il, st in alone[1].items() for k, v in st.items()
                  if not np.array_equal(v, grouped[1][il][k], equal_nan=True)), None)
    return dict(logits_equal=bool(np.array_equal(la, lg)),
                logits_max_rel=float(np.abs(la - lg).max() / max(float(np.abs(la).max()), 1e-30)),
                first_state_differing=first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default="/tmp/ds4-flash-sparse.gguf")
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=0, help="layers of the preset (0: all)")
    ap.add_argument("--prompts", default="8192,3048", help="prompt lengths, comma-separated")
    ap.add_argument("--cap", type=int, default=2048, help="the session's prefill chunk")
    ap.add_argument("--rows", type=int, default=8192, help="prefill_ffn_rows of the grouped prefill")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = preset_config(a.preset, **({"n_layer": a.layers} if a.layers else {}))
    write_sparse_gguf(a.gguf, cfg, {}, [f"<t{i}>" for i in range(cfg.n_vocab)], [])
    eng = ds4.Engine.open(a.gguf, backend="triton", synthetic=True)
    res = dict(device=torch.cuda.get_device_name(0), preset=a.preset, layers=cfg.n_layer, cap=a.cap,
               rows=a.rows, numerics=eng.backend.numerics, prompts=[])
    rng = np.random.default_rng(a.seed)
    ok = True
    for n in (int(x) for x in a.prompts.split(",") if x):
        prompt = [int(x) for x in rng.integers(0, cfg.n_vocab, n)]
        r = dict(prompt=n, **compare(prefill(eng, prompt, a.cap, 0), prefill(eng, prompt, a.cap, a.rows)))
        ok &= r["logits_equal"] and r["first_state_differing"] is None
        print(json.dumps(r), flush=True)
        res["prompts"].append(r)
    os.makedirs(a.out, exist_ok=True)
    with atomic_file(os.path.join(a.out, "group_bits.json"), "w", private=False) as f:
        json.dump(res, f, indent=1)
    print("every bit equal" if ok else "the grouped prefill differs from chunk by chunk")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
