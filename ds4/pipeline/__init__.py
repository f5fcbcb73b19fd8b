"""Pipeline split: one model served as contiguous layer ranges over qkp6 (ds4/wire/qkp.py).

The worker side is a `Stage` (layers [a, b) of one model, per-slot state and snapshots) behind a
`Worker` (the TCP server; a middle stage forwards every frame to its own next stage). The head
side is `SplitEngine`, which runs layers [0, a) locally and looks like an `Engine`:

    eng = SplitEngine.open("model.gguf", "127.0.0.1:9000", layers="0:3", sampling=params)
    s = eng.session(ctx=4096)
    s.sync(prompt_ids)
    token = s.next_token(params, rng)   # or ds4.pipeline.next_token(s, params, rng)
    s.eval(token)

What crosses a link: the mHC state rows (n_hc × n_embd float32 per token) and the token ids
(the hash-routed layers pick experts by token id). A prefill streams one frame per chunk as each
chunk's local layers finish, at most two frames in flight; the last stage answers with the greedy
id after every position and, when the head samples (temperature > 0), what sampling reads of the
final position: its top_k candidates (top_k in 1..256), else its whole logits row. The head
samples with `ds4.core.sampling.sample` and its own seeded generator, so a split run draws the
same uniforms from the same vector as an unsplit run: token-identical for every sampler and
seed. `SplitSession.sample(n, params, rng, stop)` is `Session.sample`'s loop.

Sessions own worker slots: each session OPENs its slot on the engine's connection, the worker
binds it to one of its `--slots` (the total over all heads) or refuses when all are held, and
closing the session (or the connection) gives it back (qkp.py's docstring has the protocol).

Failure: any socket or protocol error poisons the link. The request in progress fails with a
`PipelineError` (a RuntimeError: the CLI prints it as one error line); the link reconnects on the
next request; every session whose worker-side state belonged to the old connection re-prefills
its tokens from position 0 on its next sync/eval, and saved snapshots are forgotten.

Modules: `common` (limits, errors, parsing, `topk_for`), `stage` (a worker's compute), `worker`
(its TCP server and `serve`), `link` (the head's connection), `head` (`SplitEngine`,
`SplitSession`, `next_token`).
"""

from .common import (DEFAULT_CONNECT_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_IO_TIMEOUT,
                     DEFAULT_MAX_CONNS, DEFAULT_MAX_ROWS, OPEN_RETRY_PAUSES, PipelineError,
                     PipelineRefused, covers, parse_layers, topk_for)
from .head import SplitEngine, SplitSession, SplitSnapshot, next_token
from .stage import Stage, rows_to_backend
from .worker import Worker, serve

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT", "DEFAULT_IDLE_TIMEOUT", "DEFAULT_IO_TIMEOUT", "DEFAULT_MAX_CONNS",
    "DEFAULT_MAX_ROWS", "OPEN_RETRY_PAUSES", "PipelineError", "PipelineRefused", "SplitEngine",
    "SplitSession", "SplitSnapshot", "Stage", "Worker", "covers", "next_token", "parse_layers",
    "rows_to_backend", "serve", "topk_for",
]
