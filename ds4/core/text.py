"""Text at the engine's edges: every prompt, system prompt or message must be Unicode text that
UTF-8 can encode before it reaches the tokenizer."""

from __future__ import annotations

_ESCAPED_BYTES = range(0xDC80, 0xDD00)  # surrogateescape's stand-ins for the bytes 0x80-0xff


def check_utf8(text: str, what: str) -> str:
    """`text` itself if UTF-8 can encode it; else a ValueError naming `what` and the first
    character that it cannot. Text decoded with surrogateescape (argv and stdin under a UTF-8
    or C locale) holds a lone surrogate for each byte that was not UTF-8, and JSON may carry
    escaped ones ("\\ud800"); the tokenizer would fail on either with an unrelated message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        cp = ord(text[e.start])
        found = f"the byte {cp - 0xDC00:#04x}" if cp in _ESCAPED_BYTES else f"a lone surrogate U+{cp:04X}"
        raise ValueError(f"{what}: expected UTF-8 text, got {found} at character {e.start}") from None
    return text
