"""What both sides of a split share: limits, errors, layer parsing, and what the last stage must
return for a sampler (`topk_for`). Addresses are read by `ds4.wire.address`."""

from __future__ import annotations

import numpy as np

from ..core.sampling import SamplingParams
from ..wire import qkp


DEFAULT_MAX_ROWS = 512
DEFAULT_IO_TIMEOUT = 120.0
DEFAULT_IDLE_TIMEOUT = 3600.0
DEFAULT_CONNECT_TIMEOUT = 10.0
OPEN_RETRY_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8)  # seconds between OPENs a full worker refused
DEFAULT_MAX_CONNS = 64


class PipelineError(RuntimeError):
    """A split request failed (the link broke, a stage refused); the message says what to do."""


class PipelineRefused(PipelineError):
    """The next stage refused the hello, or the head refused the next stage's hello."""


def parse_layers(text: str | range, n_layer: int) -> range:
    """'A:B' (or a range) -> range(A, B), checked against the model's layer count."""
    if isinstance(text, range):
        r = text
    else:
        try:
            a, b = (int(x) for x in str(text).split(":"))
        except ValueError:
            raise ValueError(f"layers: expected A:B (e.g. 0:3), got {text!r}") from None
        r = range(a, b)
    if r.step != 1 or not 0 <= r.start < r.stop <= n_layer:
        raise ValueError(f"layers: expected A:B with 0 <= A < B <= {n_layer}, got {r.start}:{r.stop}")
    return r


def topk_for(params: SamplingParams | None) -> int:
    """What the last stage must return of the final position for the head to sample with
    `params` exactly as `ds4.core.sampling.sample` samples the whole vector: nothing (greedy:
    its argmax), the top_k candidates (top_k in 1..TOPK_MAX: the sampler reads only those), or
    the whole logits row (qkp.TOPK_LOGITS: the min-p path, top-p and larger top_k read
    tokens anywhere in the vocabulary)."""
    if params is None:
        return 0
    p = params.normalized()
    if float(np.float32(p.temperature)) <= 0.0:
        return 0
    return p.top_k if 0 < p.top_k <= qkp.TOPK_MAX else qkp.TOPK_LOGITS


def covers(have: int, need: int) -> bool:
    """Whether a reply asked with topk `have` holds what sampling needing `need` reads."""
    if need == 0 or have == qkp.TOPK_LOGITS:
        return True
    return need != qkp.TOPK_LOGITS and have >= need
