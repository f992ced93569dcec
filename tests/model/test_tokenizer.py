from __future__ import annotations

import json
import shutil

import pytest

from servelab.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "héllo wörld — naïve café, Ærøskøbing",
    "emoji 👋🏽 party 🎉 family 👨‍👩‍👧 flag 🇫🇷",
    "line one\nline two\n\n\tindented    spaces   \r\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "中文字符和日本語のテキスト、한국어",
    "  leading spaces and trailing  ",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in Roman numerals? 🏛️"},
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)


def test_special_tokens(tokenizer):
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.decode([1, 19556, 2]) == "Hello"


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:2], CHAT[1:]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    assert tokenizer.encode(ours) == hf_tokenizer.encode(theirs)


def test_chat_template_helpers(tmp_path, default_model_dir):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ bos_token }}{{ m | tojson }}{% endfor %}{% if tools is none %}!{% endif %}")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == (2, 0)
    rendered = tok.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert rendered == '<|im_start|>{"role": "user", "content": "é<b>"}!'
    with pytest.raises(Exception, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


def test_no_chat_template_is_a_clear_error(tmp_path, default_model_dir):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id is None and tok.eos_token_ids == ()
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template(CHAT)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_tiny_model_folders_load(tiny_llama_dir, tiny_qwen2_dir):
    for folder in (tiny_llama_dir, tiny_qwen2_dir):
        tok = Tokenizer.from_pretrained(folder)
        assert tok.eos_token_ids == (2,) and tok.encode("Hello") == [19556]


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detokenizer_matches_full_decode(tokenizer, text):
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = [detokenizer.add(i) for i in ids]
    assert "".join(deltas) == detokenizer.text == tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("a 👋🏽!", add_special_tokens=False)
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)  # the emoji really is split over tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    deltas = [detokenizer.add(i) for i in ids]
    assert "" in deltas[1:-1] and "".join(deltas) == "a 👋🏽!"


def test_incremental_detokenizer_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [2]
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    assert [kept.add(i) for i in ids][-1] == "<|im_end|>"
    assert [skipped.add(i) for i in ids][-1] == ""
    assert kept.text == "Hi there<|im_end|>" and skipped.text == "Hi there"
