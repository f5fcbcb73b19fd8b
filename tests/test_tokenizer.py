"""The DS4 tokenizer against DeepSeek V4's own tokenizer.json run through HF `tokenizers`."""

from __future__ import annotations

import json

import pytest
import tokenizers
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4.core.tokenizer import (SPECIAL_TOKENS, Tokenizer, real_vocabulary,
                                reference_tokenizer_json, small_vocabulary)

# The ids DeepSeek V4 gives the seven strings ds4 treats as special (from its tokenizer.json).
EXPECTED_SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜User｜>": 128803,
    "<｜Assistant｜>": 128804,
    "<think>": 128821,
    "</think>": 128822,
    "｜DSML｜": 128825,
}

CORPUS = [
    "Hello, world!",
    "def f(x):\r\n    if x > 1:\r\n        return x * 2\r\n    return 0\r\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "    return",
    "    int x;\n",
    "a >;\nb <=>\r\n\r\nc !== d;;\n\n\n",
    "x = {'k': [1, 2, 3]}  # comment\n",
    "中华人民共和国成立于1949年。今天天气很好！",
    "ひらがなとカタカナ、漢字まじり文。テスト",
    "한국어 텍스트와 English mixed",
    "Ελληνικά και русский текст, עברית, العربية",
    "3.14159265358979 and 1234567890123 and 0x1F",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and ✨",
    "spaces      inside   text",
    "trailing spaces   ",
    "\n\n\nleading newlines and \t tabs\t\t\n",
    "   \n  \n\t\n",
    "naïve café résumé — “quotes” ‘single’ …",
    "e\u0301 combining and \u00a0nbsp and \u3000ideographic space",
    "https://example.com/path?q=1&r=2#frag",
    "$HOME/bin:/usr/bin; echo \"$PATH\" | tr ':' '\\n'",
    "Mixed汉字and English交替123四五六",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ　１２３",
    "",
    " ",
    "a",
]

ALPHABET = list(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    " \t\r\n!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
    "éüßçñøåÆ" "абвгдЖЗИ" "αβγΔΩ" "中文字漢語人大" "ひらがなカタカナー" "한국"
    "٠١٢३४" "😀👍🏽✨🇫" "\u0301\u0308\u00a0\u3000\u200b\u2028" "，。！？「」【】｜▁"
)


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_vocabulary(*real_vocabulary())


@pytest.fixture(scope="module")
def reference() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(reference_tokenizer_json()))


@pytest.fixture(scope="module")
def reference_doc() -> dict:
    return json.loads(reference_tokenizer_json().read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def added_strings(reference_doc) -> list[str]:
    return [a["content"] for a in reference_doc["added_tokens"]]


def ref_ids(reference, text: str) -> list[int]:
    return reference.encode(text, add_special_tokens=False).ids


# --- vocabulary --------------------------------------------------------------------------------

def test_real_vocabulary_matches_reference(reference_doc, reference):
    tokens, merges = real_vocabulary()
    assert len(tokens) == 129280 == reference.get_vocab_size(with_added_tokens=True)
    assert len(set(tokens)) == len(tokens)
    for s, i in reference_doc["model"]["vocab"].items():
        assert tokens[i] == s
    for added in reference_doc["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
    ref_merges = [m if isinstance(m, str) else " ".join(m) for m in reference_doc["model"]["merges"]]
    assert merges == ref_merges


def test_pre_tokenizer_is_the_reference_one(ours, reference):
    # Same Split regexes, behaviours and ByteLevel flags, compared as serialized by tokenizers.
    assert (json.loads(ours._hf.to_str())["pre_tokenizer"]
            == json.loads(reference.to_str())["pre_tokenizer"])


def test_special_ids_from_reference(ours, reference_doc):
    ref = {a["content"]: a["id"] for a in reference_doc["added_tokens"]}
    assert {s: ref[s] for s in SPECIAL_TOKENS} == EXPECTED_SPECIAL_IDS
    assert ours.special_ids == EXPECTED_SPECIAL_IDS
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (0, 1, 129280)


def test_missing_special_token_is_named():
    tokens, merges = small_vocabulary(300)
    tokens = [t if t != "<｜Assistant｜>" else "<｜Helper｜>" for t in tokens]
    with pytest.raises(ValueError, match="Assistant"):
        Tokenizer.from_vocabulary(tokens, merges)


def test_duplicate_token_rejected():
    tokens, merges = small_vocabulary(300)
    tokens[-6] = tokens[5]
    with pytest.raises(ValueError, match="more than once"):
        Tokenizer.from_vocabulary(tokens, merges)


def test_merge_outside_vocabulary_rejected():
    tokens, merges = small_vocabulary(300)
    with pytest.raises(ValueError):
        Tokenizer.from_vocabulary(tokens, merges + ["Ġzzz Ġqqq"])


# --- encode against the reference ---------------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_reference(ours, reference, text):
    assert ours.encode(text) == ref_ids(reference, text)


def test_leading_spaces_leave_one_for_the_word(ours, reference):
    ids = ours.encode("    return")
    assert [ours.tokens[i] for i in ids] == ["ĠĠĠ", "Ġreturn"]
    assert [reference.id_to_token(i) for i in ref_ids(reference, "    return")] == ["ĠĠĠ", "Ġreturn"]


def test_punctuation_keeps_its_newlines(ours):
    assert [ours.tokens[i] for i in ours.encode(">;\n")] == [">;Ċ"]
    assert [ours.tokens[i] for i in ours.encode("a>;\nb")] == ["a", ">;Ċ", "b"]
    assert [ours.tokens[i] for i in ours.encode("x;\n\n  y")] == ["x", ";ĊĊ", "Ġ", "Ġy"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=st.one_of(st.sampled_from(ALPHABET), st.characters(codec="utf-8")),
                    max_size=60))
def test_encode_matches_reference_random(ours, reference, added_strings, text):
    # The reference always matches its 1283 added tokens; ds4's plain encoder matches none.
    assume(not any(a in text for a in added_strings))
    ids = ours.encode(text)
    assert ids == ref_ids(reference, text)
    assert ours.decode(ids) == text


# --- special strings ----------------------------------------------------------------------------

def test_encode_rendered_inserts_special_ids(ours, reference):
    text = ("<｜begin▁of▁sentence｜>sys<｜User｜>hi there<｜Assistant｜><think>hmm</think>ok"
            "｜DSML｜x<｜end▁of▁sentence｜>")
    ids = ours.encode_rendered(text)
    # The reference matches all added tokens; with only the seven present, it is ds4's split.
    assert ids == ref_ids(reference, text)
    assert ids[0] == 0 and ids[-1] == 1
    for s, i in EXPECTED_SPECIAL_IDS.items():
        assert ids.count(i) == text.count(s)
    assert ours.encode_rendered("<think><think>") == [128821, 128821]
    assert ours.encode_rendered("") == []


def test_plain_encode_does_not_make_specials(ours):
    assert 128821 not in ours.encode("<think>")
    assert ours.decode(ours.encode("<｜User｜>")) == "<｜User｜>"
    # other added tokens are text to ds4 even in rendered chat
    assert ours.encode_rendered("<|EOT|>") == ours.encode("<|EOT|>")


def test_decode_specials_literally(ours):
    assert ours.decode([0, 128803, 128804, 128821, 128822, 128825, 1]) == "".join(
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
         "｜DSML｜", "<｜end▁of▁sentence｜>"])
    assert ours.token_bytes(128803) == "<｜User｜>".encode()


def test_decode_rejects_bad_ids(ours):
    with pytest.raises(ValueError):
        ours.decode([129280])
    with pytest.raises(ValueError):
        ours.token_bytes(-1)


# --- decode and streaming -----------------------------------------------------------------------

@pytest.mark.parametrize("text", CORPUS)
def test_roundtrip(ours, text):
    assert ours.decode(ours.encode(text)) == text
    assert ours.decode(ours.encode_rendered(text)) == text


def stream(tok: Tokenizer, ids) -> list[str]:
    dec = tok.stream_decoder()
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_stream_holds_back_split_characters(ours):
    text = "emoji 😀👍🏽 中文 ひらがな"
    ids = ours.encode(text)
    # "😀" is spread over two tokens (" \xf0\x9f\x98" + "\x80"), so is "🏽"
    split = [i for i in ids if "\ufffd" in ours.token_bytes(i).decode("utf-8", "replace")]
    assert len(split) >= 4
    pieces = stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("text", CORPUS)
def test_stream_equals_decode(ours, text):
    ids = ours.encode_rendered("<｜Assistant｜>" + text + "<｜end▁of▁sentence｜>")
    assert "".join(stream(ours, ids)) == ours.decode(ids)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(0, 129279), st.integers(0, 1000)), max_size=24))
def test_stream_and_bytes_agree_with_decode_on_any_ids(ours, ids):
    # Arbitrary ids make invalid UTF-8; all three paths replace it the same way.
    text = ours.decode(ids)
    assert "".join(stream(ours, ids)) == text
    assert b"".join(ours.token_bytes(i) for i in ids).decode("utf-8", "replace") == text


# --- the small vocabulary -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def small() -> tuple[list[str], list[str]]:
    return small_vocabulary(512)


@pytest.fixture(scope="module")
def small_tok(small) -> Tokenizer:
    return Tokenizer.from_vocabulary(*small)


def test_small_vocabulary_layout(small, reference_doc):
    tokens, merges = small
    assert len(tokens) == 512 and len(set(tokens)) == 512
    assert tokens[:2] == ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    assert tokens[-5:] == ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"]
    assert set(tokens[2:258]) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    # a subsequence of the real merge list, in rank order
    rank = {m: r for r, m in enumerate(reference_doc["model"]["merges"])}
    ranks = [rank[m] for m in merges]
    assert ranks == sorted(ranks)


def test_small_vocabulary_sizes():
    for n in (300, 301, 1000):
        tokens, _ = small_vocabulary(n)
        assert len(tokens) == n
    with pytest.raises(ValueError):
        small_vocabulary(299)


def test_small_tokenizer_specials(small_tok):
    assert small_tok.special_ids["<｜begin▁of▁sentence｜>"] == 0
    assert small_tok.special_ids["｜DSML｜"] == 511
    ids = small_tok.encode_rendered("<｜User｜>the cat<｜Assistant｜></think>")
    assert ids[0] == 507 and ids[-2:] == [508, 510]


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.one_of(st.sampled_from(ALPHABET), st.characters(codec="utf-8")),
                    max_size=80))
def test_small_tokenizer_roundtrip(small_tok, text):
    ids = small_tok.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert small_tok.decode(ids) == text
    assert small_tok.decode(small_tok.encode_rendered(text)) == text


def test_text_that_is_not_utf8_is_refused_before_the_bpe(small_tok):
    """A lone surrogate (a non-UTF-8 byte decoded with surrogateescape, or an escaped one from
    JSON) is a ValueError naming the byte or code point and its position in the whole text;
    it reached HF tokenizers, which failed with "TextEncodeInput must be Union[...]"."""
    with pytest.raises(ValueError, match=r"^text: expected UTF-8 text, got the byte 0xe9 at character 3$"):
        small_tok.encode("caf\udce9")
    with pytest.raises(ValueError, match=r"^text: expected UTF-8 text, got a lone surrogate U\+D800 "
                                         r"at character 10$"):
        small_tok.encode_rendered("<｜User｜>ab\ud800<｜Assistant｜>")
