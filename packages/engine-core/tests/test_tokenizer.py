"""The SmolLM2 tokenizer (built from the GGUF metadata) against transformers' AutoTokenizer.

The reference is ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; its model-config
parse uses our faster ``GGUFReader`` subclass (byte-for-byte equal to the stock reader, see
test_gguf_loader.py), which changes its cost, not its result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from engine.core.model_loader import resolve_model
from engine.core.model_loader._gguf_reader import PlainViewGGUFReader
from engine.core.tokenizer import Tokenizer, load_tokenizer, read_chat_template
from engine.sdk.errors import ValidationError

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nblank lines",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский",
    "日本語のテキスト, 中文, 한국어, עברית, العربية",
    "emoji 😀👍🏽 👩‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inline: <|endoftext|><repo_name>x<file_sep> and broken <|im_start",
    "numbers 1234567890 3.14159 -42 1e-5 0xDEADBEEF",
    "   \u00a0 non-breaking\u2009thin\u200bzero-width",
    "a" * 300,
]

MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2? 🤔"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def reference() -> PreTrainedTokenizerBase:
    source = resolve_model(None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", PlainViewGGUFReader)
        return AutoTokenizer.from_pretrained(
            str(source.path), gguf_file=source.gguf_file, local_files_only=True
        )


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(
    ours: Tokenizer, reference: PreTrainedTokenizerBase, text: str
) -> None:
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == reference.encode(text, add_special_tokens=add_special_tokens)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_facts(ours: Tokenizer, reference: PreTrainedTokenizerBase) -> None:
    assert ours.eos_token_id == reference.eos_token_id == 2
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.vocab_size == len(ours) == len(reference) == 49152
    # transformers lists bos/eos/unk; decode(skip_special_tokens=True) also drops the other
    # added special tokens (<repo_name>, ..., <empty_output>): ours lists what is dropped.
    assert set(reference.all_special_ids) <= set(ours.all_special_ids)
    assert ours.all_special_ids == list(range(17))
    assert ours.decode([3, 65, 16, 66]) == reference.decode(
        [3, 65, 16, 66], skip_special_tokens=True
    )
    assert ours.convert_ids_to_tokens([1, 65, 5], skip_special_tokens=True) == ["Q"]
    assert ours.convert_ids_to_tokens([10**6]) == [""]
    tokens = ours.convert_ids_to_tokens(ours.encode("Hello world 😀"))
    assert tokens[:2] == ["Hello", "Ġworld"]
    assert ours.convert_tokens_to_string(tokens) == "Hello world 😀"
    assert ours.is_special_id(2) and not ours.is_special_id(65)


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_template_equals_transformers(
    ours: Tokenizer, reference: PreTrainedTokenizerBase, messages: list[dict[str, Any]]
) -> None:
    for add_generation_prompt in (True, False):
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert text == expected
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(expected, add_special_tokens=False)
        assert (
            ids.count(1)
            == len(messages) + (not messages[0]["role"] == "system") + add_generation_prompt
        )
    assert ours.apply_chat_template(MESSAGES[0]).endswith("<|im_start|>assistant\n")


def test_chat_template_override(ours: Tokenizer, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
        "{{ eos_token }}{% if add_generation_prompt %}>>{% endif %}"
    )
    file = tmp_path / "template.jinja"
    file.write_text(template)
    assert read_chat_template(str(file)) == template
    assert read_chat_template(template) == template
    long_one_line = "{{ bos_token }}" + "x" * 5000
    assert read_chat_template(long_one_line) == long_one_line
    with pytest.raises(ValidationError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    custom = Tokenizer(ours.hf_tokenizer, chat_template=read_chat_template(file))
    assert custom.chat_template == template
    assert custom.apply_chat_template(MESSAGES[0]) == "<|im_start|>[user] Hi!<|im_end|>>>"
    assert custom.apply_chat_template(MESSAGES[0], add_generation_prompt=False).endswith(
        "<|im_end|>"
    )
    assert ours.chat_template != template  # the original is untouched


def test_template_errors_are_validation_errors(ours: Tokenizer) -> None:
    strict = Tokenizer(
        ours.hf_tokenizer,
        chat_template=(
            "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
            "{% endif %}ok"
        ),
    )
    with pytest.raises(ValidationError, match="system first") as info:
        strict.apply_chat_template(MESSAGES[0])
    assert info.value.param == "messages"
    broken = Tokenizer(ours.hf_tokenizer, chat_template="{% for %}")
    with pytest.raises(ValidationError, match="chat template error"):
        broken.apply_chat_template(MESSAGES[0])


def test_hf_directory_without_chat_template(ours: Tokenizer, tmp_path: Path) -> None:
    ours.hf_tokenizer.save_pretrained(tmp_path)
    LlamaConfig(vocab_size=49152, num_hidden_layers=1).save_pretrained(tmp_path)
    for leftover in tmp_path.glob("chat_template.*"):
        leftover.unlink()
    config_file = tmp_path / "tokenizer_config.json"
    if config_file.exists():
        import json

        data = json.loads(config_file.read_text())
        data.pop("chat_template", None)
        config_file.write_text(json.dumps(data))
    from_dir = load_tokenizer(resolve_model(str(tmp_path)))
    for text in TEXTS:
        assert from_dir.encode(text) == ours.encode(text)
    assert from_dir.chat_template is None
    with pytest.raises(
        ValidationError, match="no chat template; pass one with --chat-template FILE"
    ):
        from_dir.apply_chat_template(MESSAGES[0])
    with_template = load_tokenizer(resolve_model(str(tmp_path)), chat_template=ours.chat_template)
    assert with_template.apply_chat_template(MESSAGES[1]) == ours.apply_chat_template(MESSAGES[1])
