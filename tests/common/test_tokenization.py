"""Tokenization shared with the gateway: byte tokenizer, segments, Jinja templates, tokenizer.json loading."""

from __future__ import annotations

import json

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from common.errors import InvalidRequestError
from common.tokenization import (
    PROBE_MESSAGES,
    ByteTokenizer,
    ChatMessage,
    DefaultChatTemplate,
    JinjaChatTemplate,
    check_template,
    encode_chat,
    load_tokenizer,
    normalize_messages,
    segments_match_whole,
)

pytestmark = pytest.mark.unit

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_byte_tokenizer_bytes_and_specials():
    tok = ByteTokenizer()
    assert tok.encode("aé<|im_start|>b") == [97, 195, 169, 258, 98]
    assert tok.decode([97, 195, 169, 258, 98]) == "aéb"
    assert (tok.vocab_size, tok.eos_token_id) == (261, 257)


def test_default_template_segments_and_tokens():
    msgs = normalize_messages(
        [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    )
    rendered = DefaultChatTemplate().render_segments(msgs)
    assert rendered.segments == ("<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>assistant\n")
    assert encode_chat(ByteTokenizer(), DefaultChatTemplate(), msgs) == [
        258,
        *b"user\nhi",
        259,
        10,
        258,
        *b"assistant\n",
    ]
    assert segments_match_whole(ByteTokenizer(), rendered)


def test_jinja_segments_are_incremental_and_equal_the_default():
    tmpl = JinjaChatTemplate(CHATML, bos_token="<|bos|>")
    rendered = tmpl.render_segments(list(PROBE_MESSAGES))
    assert rendered.is_incremental and len(rendered.segments) == len(PROBE_MESSAGES) + 1
    assert rendered.segments[0].startswith("<|bos|><|im_start|>system\n")
    assert rendered.text == "<|bos|>" + DefaultChatTemplate().render_segments(list(PROBE_MESSAGES)).text
    assert check_template(ByteTokenizer(), tmpl)


def test_jinja_template_depending_on_last_message_falls_back_to_one_segment():
    src = "{% for m in messages %}{{ m.content }}{% if loop.last %}!{% endif %}{% endfor %}"
    rendered = JinjaChatTemplate(src).render_segments([ChatMessage("user", "a"), ChatMessage("user", "b")])
    assert rendered.segments == ("ab!",) and not rendered.is_incremental


def test_jinja_raise_exception_is_a_bad_request():
    tmpl = JinjaChatTemplate("{{ raise_exception('only user') }}")
    with pytest.raises(InvalidRequestError):
        tmpl.render_segments([ChatMessage("user", "a")])


def test_load_tokenizer_json_dir_with_jinja(tmp_path):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "\n": 5}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>"},
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}</s>{% endfor %}",
            }
        )
    )
    tokenizer, template = load_tokenizer(tmp_path)
    assert tokenizer.eos_token_id == 2
    ids = encode_chat(tokenizer, template, [ChatMessage("user", "hello world"), ChatMessage("user", "world")])
    assert ids == [1, 3, 4, 2, 4, 2]
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    _, template2 = load_tokenizer(tmp_path / "tokenizer.json")
    assert encode_chat(tokenizer, template2, [ChatMessage("user", "hello")]) == [3]
