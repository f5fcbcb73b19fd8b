"""The DS4 chat template as the ds4 CLI builds it (spec §5).

ds4 builds prompts as token sequences, part by part: a special token is pushed by id, and every
piece of text (system text, one message's content, the "Tool: " label) is BPE'd on its own. A
prompt here is the same list of parts, which can be

  * rendered to text (`render_chat`, `render_prompt`): for display, for the server, or for
    `Tokenizer.encode_rendered`;
  * encoded part by part (`encode_chat`, `encode_prompt`): the ids ds4's
    `ds4_encode_chat_prompt` / `ds4_chat_append_message` produce.

The two routes give the same ids unless text parts touch (two system messages in a row, the
"Tool: " label and its content: the text route BPEs them as one piece) or message text holds
one of the seven special strings (the text route makes it a special token, ds4 does not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .tokenizer import ASSISTANT, BOS, THINK_END, THINK_START, USER, Tokenizer

DEFAULT_SYSTEM = "You are a helpful assistant"

# ds4's DS4_REASONING_EFFORT_MAX_PREFIX: the Think-Max prompt, placed right after BOS. ds4
# only uses it when the context holds at least THINK_MAX_MIN_CONTEXT tokens.
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
THINK_MAX_MIN_CONTEXT = 393216

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass
class Message:
    role: str  # one of ROLES; "function" is an alias of "tool"
    content: str


# A prompt part: (True, special-token string) or (False, text to BPE on its own).
Part = tuple[bool, str]  # (is a special token, its text)


def _message_parts(message: Message | Mapping) -> list[Part]:
    if isinstance(message, Mapping):
        role, content = message["role"], message.get("content") or ""
    else:
        role, content = message.role, message.content
    if role in ("system", "developer"):
        return [(False, content)]
    if role == "user":
        return [(True, USER), (False, content)]
    if role == "assistant":
        # A turn that carries its own reasoning markers keeps them; any other past turn is
        # closed as a non-thinking answer.
        if content.startswith((THINK_START, THINK_END)):
            return [(True, ASSISTANT), (False, content)]
        return [(True, ASSISTANT), (True, THINK_END), (False, content)]
    if role in ("tool", "function"):
        return [(True, USER), (False, "Tool: "), (False, content)]
    raise ValueError(f"unknown chat role {role!r}; accepted roles: {', '.join(ROLES)}")


def _generation_prompt(think: bool) -> list[Part]:
    return [(True, ASSISTANT), (True, THINK_START if think else THINK_END)]


def _chat_parts(messages: Iterable[Message | Mapping], think: bool, add_generation_prompt: bool,
                think_max: bool) -> list[Part]:
    parts: list[Part] = [(True, BOS)]
    if think_max:
        parts.append((False, THINK_MAX_PREFIX))
    for message in messages:
        parts += _message_parts(message)
    if add_generation_prompt:
        parts += _generation_prompt(think)
    return parts


def _prompt_parts(prompt: str, system: str | None, think: bool, think_max: bool) -> list[Part]:
    parts: list[Part] = [(True, BOS)]
    if think_max:
        parts.append((False, THINK_MAX_PREFIX))
    if system:
        parts.append((False, system))
    return parts + [(True, USER), (False, prompt)] + _generation_prompt(think)


def render_parts(parts: list[Part]) -> str:
    return "".join(text for _, text in parts)


def encode_parts(tokenizer: Tokenizer, parts: list[Part]) -> list[int]:
    """Token ids of rendered parts: a special part is its one id, text is tokenized."""
    ids: list[int] = []
    for special, text in parts:
        if special:
            ids.append(tokenizer.special_ids[text])
        else:
            ids += tokenizer.encode(text)
    return ids


def render_chat(messages: Iterable[Message | Mapping], *, think: bool = True,
                add_generation_prompt: bool = True, think_max: bool = False) -> str:
    """BOS, [Think-Max prefix], the messages in order, then `<｜Assistant｜>` and `<think>`
    (or `</think>` when not thinking) if `add_generation_prompt`."""
    return render_parts(_chat_parts(messages, think, add_generation_prompt, think_max))


def render_prompt(prompt: str, *, system: str | None = DEFAULT_SYSTEM, think: bool = True,
                  think_max: bool = False) -> str:
    """The CLI's single-turn prompt; `system=None` or "" leaves the system text out."""
    return render_parts(_prompt_parts(prompt, system, think, think_max))


def encode_chat(tokenizer: Tokenizer, messages: Iterable[Message | Mapping], *, think: bool = True,
                add_generation_prompt: bool = True, think_max: bool = False) -> list[int]:
    """The ids of `render_chat`'s prompt as ds4 builds them (each text part BPE'd on its own)."""
    return encode_parts(tokenizer, _chat_parts(messages, think, add_generation_prompt, think_max))


def encode_prompt(tokenizer: Tokenizer, prompt: str, *, system: str | None = DEFAULT_SYSTEM,
                  think: bool = True, think_max: bool = False) -> list[int]:
    """The ids of `render_prompt`'s prompt as `ds4_encode_chat_prompt` builds them."""
    return encode_parts(tokenizer, _prompt_parts(prompt, system, think, think_max))
