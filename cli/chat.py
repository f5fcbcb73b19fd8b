"""`ds4 chat`: a multi-turn chat in the terminal on one session.

Each turn appends `<｜User｜>text<｜Assistant｜><think>` (or `</think>`) to the tokens the session
already holds (the previous prompt, reply and end-of-sentence), so only the new turn is
prefilled. Commands: /reset, /save FILE (the session as a DSV4 payload), /think on|off, /help,
/quit (or Ctrl-D).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Annotated

import typer
from rich.text import Text

from ds4.core.chat import DEFAULT_SYSTEM
from ds4.core.payload import PayloadError
from ds4.core.text import check_utf8

from .common import (CLIError, check_output, check_prefill_cap, err, library_errors, open_engine,
                     output_file, print_error, rate)
from .options import (MAX_SEED, BackendOption, CtxOption, MinPOption, ModelOption, NoThinkOption,
                      NumericsOption, PrefillCapOption, SeedOption, SystemOption, TempOption, TopKOption,
                      TopPOption, check_range)

HELP = ("commands: /reset (forget the conversation), /save FILE (write the session as a DSV4 "
        "payload), /think on|off, /help, /quit")


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)


def turn_tokens(tokenizer, held: list[int], text: str, think: bool, system: str | None) -> list[int]:
    """The session's tokens after one more user turn and the generation prompt."""
    from ds4.core.tokenizer import ASSISTANT, BOS, THINK_END, THINK_START, USER
    from ds4.core.chat import encode_parts

    parts = []
    if not held:
        parts += [(True, BOS)] + ([(False, system)] if system else [])
    elif held[-1] != tokenizer.eos_id:  # the last reply was cut off: close it
        held = held + [tokenizer.eos_id]
    parts += [(True, USER), (False, text), (True, ASSISTANT), (True, THINK_START if think else THINK_END)]
    return list(held) + encode_parts(tokenizer, [p for p in parts if p[0] or p[1]])


def chat(
    model: ModelOption = None,
    tokens: Annotated[int, typer.Option(
        "--tokens", "-n", metavar="N", callback=check_range(1),
        help="Most tokens of one reply.")] = 512,
    temp: TempOption = 1.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    min_p: MinPOption = 0.05,
    seed: SeedOption = None,
    nothink: NoThinkOption = False,
    system: SystemOption = DEFAULT_SYSTEM,
    ctx: CtxOption = 4096,
    prefill_cap: PrefillCapOption = None,
    backend: BackendOption = "auto",
    numerics: NumericsOption = "ds4",
) -> None:
    """Chat with the model in the terminal: multi-turn on one session (only new turns are
    prefilled), the reply streamed (the reasoning dimmed). /help lists the commands."""
    from ds4.core.sampling import Rng, SamplingParams
    from ds4.serve.reply import REASONING, ReplyStream

    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")
    with contextlib.suppress(AttributeError, ValueError):  # a line that is not UTF-8 is said below
        sys.stdin.reconfigure(errors="surrogateescape")
    with library_errors():
        check_prefill_cap(prefill_cap, ctx)
    eng = open_engine(model, backend, numerics)
    with library_errors():
        tok = eng.tokenizer  # (the vocabulary is read here, on first use)
        if ctx > eng.config.context_length:
            raise ValueError(f"--ctx {ctx} is more than the model's context_length "
                             f"{eng.config.context_length}")
        session = eng.session(ctx=ctx, prefill_cap=prefill_cap)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    rng = Rng(time.time_ns() & MAX_SEED if seed is None else seed)
    think = not nothink
    err.print(Text(HELP, style="dim"), soft_wrap=True)
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            arg = arg.strip()
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                err.print(Text(HELP, style="dim"), soft_wrap=True)
            elif cmd == "/reset":
                session.sync([])
                err.print(Text("conversation reset", style="dim"))
            elif cmd == "/think" and arg in ("on", "off"):
                think = arg == "on"
                err.print(Text(f"thinking {arg}", style="dim"))
            elif cmd == "/save" and arg:
                if not session.tokens:
                    err.print(Text("nothing to save yet", style="yellow"))
                    continue
                try:  # (a failed save is said, and the conversation goes on)
                    dest = output_file(arg, "/save")
                    check_output(dest, "/save", getattr(eng.model, "path", None))
                    size = session.save_payload(dest)
                except (CLIError, OSError, PayloadError) as e:
                    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                    err.print(Text(f"not saved to {arg}: {why}", style="yellow"), soft_wrap=True)
                    continue
                err.print(Text(f"saved {len(session.tokens)} tokens to {arg} ({size:,} bytes)", style="dim"))
            else:
                err.print(Text(f"unknown command {text!r}; {HELP}", style="yellow"), soft_wrap=True)
            continue
        try:  # (a byte that is not UTF-8 arrives as a lone surrogate: said, and the chat goes on)
            check_utf8(line, "this line")
        except ValueError as e:
            print_error(f"{e} (not sent)")
            continue
        held = session.tokens
        ids = turn_tokens(tok, held, text, think, system or None)
        if len(ids) >= ctx:
            err.print(Text(f"the conversation ({len(ids)} tokens) fills the context (--ctx {ctx}); "
                           "/reset to start again", style="yellow"))
            continue
        with library_errors():
            t0 = time.perf_counter()
            session.sync(ids)
            t_prefill = time.perf_counter() - t0
        reply = ReplyStream(tok, think=think)
        generated, t1 = 0, time.perf_counter()
        steps = session.sample(min(tokens, ctx - len(ids)), params, rng, stop={tok.eos_id})
        try:
            with library_errors(), contextlib.closing(steps):
                for token in steps:
                    if token == tok.eos_id:
                        break
                    generated += 1
                    _show(reply.push(token), REASONING)
        except KeyboardInterrupt:
            err.print(Text("(interrupted)", style="yellow"))
        _show(reply.finish()[0], REASONING)
        sys.stdout.write("\n")
        sys.stdout.flush()
        err.print(Text(f"prefilled {len(ids) - len(held)} new tokens ({len(held)} reused), "
                       f"{rate(len(ids) - len(held), t_prefill)} · generated {generated} tokens, "
                       f"{rate(generated, time.perf_counter() - t1)}", style="dim"), soft_wrap=True)


def _show(pieces, reasoning_channel: str) -> None:
    for channel, text in pieces:
        if channel == reasoning_channel:
            sys.stdout.write(f"\x1b[2m{text}\x1b[0m" if sys.stdout.isatty() else text)
        else:
            sys.stdout.write(text)
    sys.stdout.flush()
