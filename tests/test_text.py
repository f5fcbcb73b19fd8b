"""ds4.core.text.check_utf8 against strings built by hand: valid text passes unchanged, a byte
that was not UTF-8 (as surrogateescape decodes argv) and an escaped lone surrogate (as JSON
carries one) are refused naming the field, the byte or code point, and the position."""

import pytest

from ds4.core.text import check_utf8


def test_valid_text_passes_unchanged():
    for s in ("", "café", "日本語 ✓", "a\x00b", "\U0001F600"):
        assert check_utf8(s, "--prompt") is s


def test_a_byte_that_was_not_utf8_is_named():
    raw = b"caf\xe9 ok"
    text = raw.decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match=r"^--prompt: expected UTF-8 text, got the byte 0xe9 at character 3$"):
        check_utf8(text, "--prompt")


def test_a_lone_surrogate_is_named():
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content: expected UTF-8 text, got a lone surrogate "
                                         r"U\+D800 at character 1$"):
        check_utf8("a\ud800b", "messages[0].content")
