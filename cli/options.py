"""Option definitions shared by the commands (model, backend, numerics, context, sampling).

Each is an `Annotated` type, so a command declares e.g. `model: ModelOption = None` and gets the
same flags, help text and validation as every other command.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

import typer

from ds4.backends import BACKENDS
from ds4.core.state import DEFAULT_PREFILL_CAP

# Literal[...] built from the registry, so a backend added there is accepted here too.
BackendName = Literal[tuple(BACKENDS)]  # type: ignore[valid-type]
NumericsName = Literal["ds4", "exact"]

MAX_SEED = (1 << 64) - 1


def check_range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False):
    """A callback that rejects NaN/inf and values outside [lo, hi] (or (lo, hi] with lo_open)."""

    def callback(value):
        if value is None:
            return value
        if isinstance(value, float) and not math.isfinite(value):
            raise typer.BadParameter(f"expected a finite number, got {value}")
        too_low = lo is not None and (value <= lo if lo_open else value < lo)
        too_high = hi is not None and value > hi
        if too_low or too_high:
            left = "(" if lo_open else "["
            lo_s = "-inf" if lo is None else f"{lo:g}"
            hi_s = "inf" if hi is None else f"{hi:g}"
            right = ")" if hi is None else "]"
            raise typer.BadParameter(f"expected a value in {left}{lo_s}, {hi_s}{right}, got {value}")
        return value

    return callback


def check_hostport(value: str, option: str, *, default_host: str | None = None,
                   any_port: bool = False) -> tuple[str, int]:
    """An address option's value as (host, port), read by ds4.wire.address's one rule (see
    parse_hostport for default_host and any_port); a bad one is a command-line error naming
    `option` (exit 2)."""
    from ds4.wire.address import AddressError, parse_hostport

    try:
        return parse_hostport(value, option, default_host=default_host, any_port=any_port)
    except AddressError as e:
        raise typer.BadParameter(e.detail, param_hint=f"'{option}'") from None


def check_text(text: str, option: str, source: str = "") -> str:
    """`text` if UTF-8 can encode it; else a command-line error (exit 2) naming `option`, the
    byte that was not UTF-8 and its position (in `source`, e.g. "stdin", where it came from)."""
    from ds4.core.text import check_utf8

    try:
        return check_utf8(text, option)
    except ValueError as e:
        detail = str(e).removeprefix(f"{option}: ")
        raise typer.BadParameter(f"{source}: {detail}" if source else detail,
                                 param_hint=f"'{option}'") from None


def text_option(option: str) -> Callable[[Optional[str]], Optional[str]]:
    """An option's callback that refuses text UTF-8 cannot encode (see check_text)."""
    return lambda value: value if value is None else check_text(value, option)


# ---- model and engine ---------------------------------------------------------------------------

ModelOption = Annotated[Optional[Path], typer.Option(
    "--model", "-m", metavar="GGUF", show_default=False, dir_okay=False,
    help="DS4 GGUF model file. Default: the embedded default model (a tiny synthetic DS4 model "
         "with the real vocabulary, created in the ds4 cache on first use; DS4_CACHE moves it).")]

ModelArgument = Annotated[Optional[Path], typer.Argument(
    metavar="[MODEL]", show_default=False, dir_okay=False,
    help="DS4 GGUF model file. Default: the embedded default model.")]

BackendOption = Annotated[BackendName, typer.Option(
    "--backend", "-b",
    help="Compute backend: auto (triton where CUDA is present, mlx on Apple silicon, else "
         "reference; the choice is printed), reference (numpy, runs anywhere), triton (CUDA), "
         "mlx (Metal).")]

NumericsOption = Annotated[NumericsName, typer.Option(
    "--numerics",
    help="ds4: simulate ds4's FP8 K/V, FP4 indexer and f16 cache rounding (what the real "
         "engine computes); exact: plain float32 math (for comparing with transformers).")]

CtxOption = Annotated[int, typer.Option(
    "--ctx", "-c", metavar="TOKENS", callback=check_range(2),
    help="Session context size in tokens (prompt + generated); at most the model's "
         "context_length.")]

PrefillCapOption = Annotated[Optional[int], typer.Option(
    "--prefill-cap", metavar="TOKENS", callback=check_range(1),
    show_default=f"{DEFAULT_PREFILL_CAP}, or --ctx if smaller",
    help="Prompt tokens per prefill chunk (the session's prefill_cap; ds4's DS4_METAL_PREFILL_CHUNK). "
         "Larger chunks prefill long prompts faster on Triton (bench/triton/README.md) and take more "
         "memory. A saved session records its chunk, and ds4 loads it only into a session of the same "
         "chunk.")]

# ---- prompt -------------------------------------------------------------------------------------

PROMPT_HELP = ("The user message; '-' reads it from stdin, less one trailing newline (\\n or "
               "\\r\\n, as echo and a here-string add).")

PromptOption = Annotated[str, typer.Option(
    "--prompt", "-p", metavar="TEXT", show_default=False, help=PROMPT_HELP)]

SystemOption = Annotated[str, typer.Option(
    "--system", metavar="TEXT", callback=text_option("--system"),
    help="System text placed before the user message; --system '' leaves it out.")]

NoThinkOption = Annotated[bool, typer.Option(
    "--nothink",
    help="Open the answer with </think> instead of <think>, so the model answers without "
         "reasoning first.")]

# ---- sampling -----------------------------------------------------------------------------------

TempOption = Annotated[float, typer.Option(
    "--temp", "-t", callback=check_range(0.0),
    help="Sampling temperature; 0 is greedy (argmax, no random draw).")]

TopKOption = Annotated[int, typer.Option(
    "--top-k", callback=check_range(0),
    help="Sample among the k most likely tokens only; 0 turns it off (ds4 caps it at 1024).")]

TopPOption = Annotated[float, typer.Option(
    "--top-p", callback=check_range(0.0, 1.0, lo_open=True),
    help="Nucleus sampling: keep the most likely tokens up to this cumulative probability; "
         "1 turns it off.")]

MinPOption = Annotated[float, typer.Option(
    "--min-p", callback=check_range(0.0, 1.0),
    help="Drop tokens whose probability is below min-p times the best token's; 0 turns it off.")]

SeedOption = Annotated[Optional[int], typer.Option(
    "--seed", "-s", callback=check_range(0, MAX_SEED), show_default="time",
    help="Seed of ds4's xorshift64* sampler; the same seed, prompt and options give the same "
         "text. The seed used is printed with the stats.")]


TokensOption = Annotated[int, typer.Option(
    "--tokens", "-n", metavar="N", callback=check_range(0),
    help="Generate at most N tokens (fewer if the model emits end-of-sentence or the "
         "context fills).")]
