"""The request view: chat rendering flags and the cache-salt rule, checked against the worker's own tokenization
and the public block hash."""

from __future__ import annotations

import pytest

from common.tokenization import ChatMessage, encode_chat, encode_prompt, load_tokenizer
from router.block_hash import hash_token_blocks, make_namespace
from router.config import ModelConfig
from router.errors import InvalidFieldError
from router.request_view import ModelTokenizer, parse_request

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
TOKENIZER, TEMPLATE = load_tokenizer(None)
MESSAGES = [{"role": "system", "content": "S" * 40}, {"role": "user", "content": "U" * 45}]
CHAT_MESSAGES = [ChatMessage(m["role"], m["content"]) for m in MESSAGES]


def make_tokenizer(**fields: object) -> ModelTokenizer:
    return ModelTokenizer(ModelConfig(name="m", block_size=BLOCK_SIZE, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_view_renders_the_generation_prompt_as_asked(add_generation_prompt) -> None:
    body = b'{"model": "m", "messages": [{"role": "system", "content": "%s"}, {"role": "user", "content": "%s"}]' % (
        b"S" * 40, b"U" * 45)
    if not add_generation_prompt:
        body += b', "add_generation_prompt": false'
    parsed = parse_request("chat", body + b"}")
    assert parsed.add_generation_prompt is add_generation_prompt
    ids = encode_chat(TOKENIZER, TEMPLATE, CHAT_MESSAGES, add_generation_prompt)
    tokenizer = make_tokenizer()
    view = tokenizer.view(parsed)
    assert (view.num_tokens, view.block_hashes) == (len(ids), tuple(hash_token_blocks(ids, BLOCK_SIZE)))
    # <|im_start|>system\n{40}<|im_end|>\n is 50 tokens, the user's 53, and <|im_start|>assistant\n 11 more.
    assert view.num_tokens == (114 if add_generation_prompt else 103)
    # The other rendering, from the prefix states the first one cached, is exact too.
    other = parse_request("chat", body.replace(b', "add_generation_prompt": false', b"")
                          + (b', "add_generation_prompt": false}' if add_generation_prompt else b"}"))
    other_ids = encode_chat(TOKENIZER, TEMPLATE, CHAT_MESSAGES, not add_generation_prompt)
    other_view = tokenizer.view(other)
    assert other_view.num_reused_blocks > 0
    assert (other_view.num_tokens, other_view.block_hashes) == (
        len(other_ids), tuple(hash_token_blocks(other_ids, BLOCK_SIZE)))


def test_completions_request_always_has_the_default_flag() -> None:
    parsed = parse_request("completions", b'{"model": "m", "prompt": "x", "add_generation_prompt": false}')
    assert parsed.add_generation_prompt is True


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_empty_cache_salt_is_refused_as_vllm_does(kind) -> None:
    body = (b'{"model": "m", "prompt": "salt probe", "cache_salt": ""}' if kind == "completions"
            else b'{"model": "m", "messages": [{"role": "user", "content": "salt probe"}], "cache_salt": ""}')
    parsed = parse_request(kind, body)
    with pytest.raises(InvalidFieldError) as info:
        make_tokenizer().view(parsed)
    assert (info.value.message, info.value.param, info.value.status) == (
        "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt", 400)


def test_empty_cache_salt_without_salt_semantics_is_no_salt() -> None:
    parsed = parse_request("completions", b'{"model": "m", "prompt": "salt probe", "cache_salt": ""}')
    view = make_tokenizer(honor_cache_salt=False).view(parsed)
    ids = encode_prompt(TOKENIZER, "salt probe")
    assert view.block_hashes == tuple(hash_token_blocks(ids, BLOCK_SIZE, make_namespace(None, None)))


def test_non_empty_cache_salt_is_its_own_namespace() -> None:
    parsed = parse_request("completions", b'{"model": "m", "prompt": "salt probe", "cache_salt": "t"}')
    view = make_tokenizer().view(parsed)
    ids = encode_prompt(TOKENIZER, "salt probe")
    assert view.block_hashes == tuple(hash_token_blocks(ids, BLOCK_SIZE, make_namespace(None, "t")))
