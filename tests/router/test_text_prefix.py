"""Incremental text prompts: the ids of a prompt tokenized from an earlier prompt's checkpoint equal one whole
encoding, with a real byte-level BPE (Llama-3's pre-tokenizer, trained here), including joins that split a merge."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from benchmarks._bpe import build_bpe
from common.line_split import composes_at_line_starts, is_line_start, last_line_start, line_start_slices
from common.tokenization import ByteTokenizer, HFTokenizer
from router.block_hash import hash_token_blocks
from router.config import ModelConfig
from router.request_view import ModelTokenizer, PromptView, ViewPlan, parse_request

pytestmark = pytest.mark.unit

BLOCK_SIZE = 4
WORDS = ["hello", "world", "hel", "lo", "don't", "it's", "12345", "3.14", "  ", "\t", "->", "==", "(x)", "ünï",
         "代码", "café", "'ll", "end.", ";", "\n", "\n\n", " \n", "\r\n", "def", "return", "self", "None"]


def _text(rng: random.Random, n: int) -> str:
    parts = []
    for _ in range(n):
        w = rng.choice(WORDS)
        parts.append(w + rng.choice(["", " ", " ", "\n", "  ", ".\n"]))
    return "".join(parts)


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(7)
    corpus = [_text(rng, 400) for _ in range(200)] + ["hello world\n" * 50, "hello\nworld\n" * 50]
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    build_bpe(path, corpus, vocab_size=800)
    return path


def _model(path: Path) -> ModelTokenizer:
    return ModelTokenizer(ModelConfig(name="m", block_size=BLOCK_SIZE, tokenizer_path=str(path)),
                          text_anchor_chars=64)


def _completion(prompt: str) -> bytes:
    import json

    return json.dumps({"model": "m", "prompt": prompt}).encode()


def test_the_bpe_merges_across_the_planted_join(bpe_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    assert len(tok.encode("hello")) == 1  # so a prompt ending in "hel" then continued with "lo" splits a merge
    assert tok.encode("hel") + tok.encode("lo") != tok.encode("hello")


def test_composition_holds_at_every_line_start_and_is_detected(bpe_path: Path, tmp_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    assert composes_at_line_starts(tok)
    rng = random.Random(11)
    checked = 0
    for _ in range(30):
        text = _text(rng, 120)
        for b in range(len(text) + 1):
            if is_line_start(text, b):
                assert tok.encode(text[:b]) + tok.encode(text[b:]) == tok.encode(text), (text, b)
                checked += 1
    assert checked > 200
    assert composes_at_line_starts(ByteTokenizer())
    assert not composes_at_line_starts(ByteTokenizer(("<|a|>", "<|b|>", "x\ny")))
    # A normalizer or a metaspace pre-tokenizer (which prepends "▁" to each piece) is refused.
    from tokenizers import Tokenizer, normalizers, pre_tokenizers

    raw = Tokenizer.from_file(str(bpe_path))
    raw.normalizer = normalizers.NFC()
    raw.save(str(tmp_path / "nfc.json"))
    assert not composes_at_line_starts(HFTokenizer(tmp_path / "nfc.json"))
    raw = Tokenizer.from_file(str(bpe_path))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.save(str(tmp_path / "metaspace.json"))
    assert not composes_at_line_starts(HFTokenizer(tmp_path / "metaspace.json"))


def test_line_start_helpers() -> None:
    text = "ab\ncd \n ef\n\ngh\nij"
    assert [b for b in range(len(text) + 1) if is_line_start(text, b)] == [3, 15]
    assert last_line_start(text, 0, len(text)) == 15
    assert last_line_start(text, 3, 14) == -1  # strictly after start
    assert last_line_start(text, 2, 14) == 3
    long = "x" * 5 + "\n" + ("word\n" * 40)
    slices = line_start_slices(long, 0, len(long), 30)
    assert slices[0][0] == 0 and slices[-1][1] == len(long)
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))
    assert all(is_line_start(long, b) for b, _ in slices[1:])


def _expected(tok: HFTokenizer, prompt: str) -> tuple[int, tuple[int, ...]]:
    ids = tok.encode(prompt)
    return len(ids), tuple(hash_token_blocks(ids, BLOCK_SIZE))


def test_turns_are_exact_and_tokenize_only_the_new_text(bpe_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    model = _model(bpe_path)
    rng = random.Random(3)
    prompt = "system: you are a coder\n" + _text(rng, 60)
    # Each turn appends text; the joins include a split merge ("hel" | "lo"), a newline followed by whitespace
    # (not a line start), a newline followed by a word, and text without any newline.
    endings = ["hel", "lo world\n", " indented\n", "next\nline", "hel", "lo", "\n\nhello", " more words"]
    reused = []
    for i in range(24):
        prompt += endings[i % len(endings)] + (_text(rng, 15) if i % 3 == 0 else "")
        view = model.view(parse_request("completions", _completion(prompt)))
        assert (view.num_tokens, view.block_hashes) == _expected(tok, prompt), i
        reused.append(view.num_reused_blocks)
    assert reused[0] == 0 and all(r > 0 for r in reused[2:])
    assert model.texts.num_hits >= 20
    assert len(model.texts) == 1  # each turn's checkpoint superseded the one it used


def test_a_prompt_that_diverges_from_a_checkpoint_does_not_use_it(bpe_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    model = _model(bpe_path)
    common = "shared system prompt of the fleet\n" * 4
    first = common + "alpha beta\ngamma delta\nepsilon\n"
    model.view(parse_request("completions", _completion(first)))
    # Same anchor, different text before the checkpoint: the exact prefix check refuses it.
    other = common + "alpha bets\ngamma delta\nepsilon\nmore"
    view = model.view(parse_request("completions", _completion(other)))
    assert (view.num_tokens, view.block_hashes) == _expected(tok, other)
    assert view.num_reused_blocks == 0
    # The checkpoint's own continuation with whitespace right after the cut is refused too (not a line start).
    cut_at = first.rindex("\n", 0, len(first) - 1) + 1
    spaced = first[:cut_at] + " epsilon\n"
    view = model.view(parse_request("completions", _completion(spaced)))
    assert (view.num_tokens, view.block_hashes) == _expected(tok, spaced)


def test_long_prompts_are_tokenized_off_the_loop_in_slices_exactly(bpe_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    model = _model(bpe_path)
    rng = random.Random(5)
    prompt = "\n".join(_text(rng, 10).replace("\n", " ") + "end" for _ in range(6000))
    assert len(prompt) > 200_000
    plan = model.plan(parse_request("completions", _completion(prompt)))
    assert len(plan.texts) > 4  # cut at line starts into slices the library encodes in parallel
    view = asyncio.run(model.view_async(parse_request("completions", _completion(prompt)), off_loop_chars=1000))
    assert (view.num_tokens, view.block_hashes) == _expected(tok, prompt)
    longer = prompt + "\nhello world\n"
    view = asyncio.run(model.view_async(parse_request("completions", _completion(longer)), off_loop_chars=1000))
    assert (view.num_tokens, view.block_hashes) == _expected(tok, longer)
    assert view.num_reused_blocks > 0


def test_long_chat_messages_are_sliced_exactly(bpe_path: Path) -> None:
    import json

    from common.tokenization import ChatMessage, encode_chat

    model = _model(bpe_path)
    rng = random.Random(9)
    content = "\n".join(_text(rng, 8).replace("\n", " ") + "x" for _ in range(8000))
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    view = asyncio.run(model.view_async(parse_request("chat", body), off_loop_chars=1000))
    ids = encode_chat(model.tokenizer, model.template, [ChatMessage("user", content)])
    assert (view.num_tokens, view.block_hashes) == (len(ids), tuple(hash_token_blocks(ids, BLOCK_SIZE)))


def test_a_continued_prompt_costs_no_whole_prompt_key_and_a_short_repeat_is_one_lookup(bpe_path: Path) -> None:
    tok = HFTokenizer(bpe_path)
    model = _model(bpe_path)
    rng = random.Random(11)
    prompt = "system: you are a coder\n" + _text(rng, 800)
    model.view(parse_request("completions", _completion(prompt)))
    assert len(model._prompts) == 1  # a first turn is keyed whole (a retry of it is one lookup)
    longer = prompt + "user: more\n" + _text(rng, 50)
    plan = model.plan(parse_request("completions", _completion(longer)))
    assert isinstance(plan, ViewPlan) and plan.num_chars < len(longer) - len(prompt) + 200  # the new text only
    view = plan.finish(model.encode_many(plan.texts))
    assert (view.num_tokens, view.block_hashes) == _expected(tok, longer)
    assert len(model._prompts) == 1  # it extended a checkpoint: no whole-prompt key was made
    short = "a short prompt\nof two lines"
    first = model.view(parse_request("completions", _completion(short)))
    again = model.plan(parse_request("completions", _completion(short)))
    assert isinstance(again, PromptView) and (again.num_tokens, again.block_hashes) == (first.num_tokens,
                                                                                        first.block_hashes)


def test_a_lookup_from_a_thread_skips_a_checkpoint_the_loop_evicted_meanwhile():
    """``find`` and ``PrefixStateCache.get`` run in a tokenizer thread for a huge prompt (``OFF_LOOP_PLAN_CHARS``)
    while the loop may evict: an id still listed in its bucket but gone from the entries (the state between the
    two steps of an eviction, as a thread can see it) is skipped, not a ``KeyError``."""
    from router.prompt_state import EMPTY_STATE, PrefixStateCache
    from router.text_prefix import TextCheckpoint, TextPrefixCache

    cache = TextPrefixCache(anchor_chars=4)
    prompt = "line one\nline two\nline three\n"
    key = cache.anchor(prompt, seed=1)
    assert key is not None
    cache.put(key, TextCheckpoint("line one\n", EMPTY_STATE))
    cache.put(key, TextCheckpoint("line one\nline two\n", EMPTY_STATE))
    found = cache.find(key, prompt)
    assert found is not None and found[1].prefix == "line one\nline two\n"
    del cache._entries[found[0]]  # evicted by the loop; its bucket not yet updated
    found = cache.find(key, prompt)
    assert found is not None and found[1].prefix == "line one\n"
    cache._entries.clear()
    assert cache.find(key, prompt) is None

    states = PrefixStateCache(4, 1 << 20)
    states.put(7, EMPTY_STATE)
    assert states.get(7) is EMPTY_STATE and states.get(8) is None


def test_encode_many_is_one_batch_call_with_the_single_encodings_ids(bpe_path: Path) -> None:
    model = _model(bpe_path)
    tok = HFTokenizer(bpe_path)
    rng = random.Random(11)
    texts = ["", "a", "<|begin_of_text|>hello", *(_text(rng, n) for n in (1, 3, 40, 900))]
    calls: list[int] = []
    batch = model._encode_batch
    assert batch is not None

    def counted(ts):  # type: ignore[no-untyped-def]
        calls.append(len(ts))
        return batch(ts)

    model._encode_batch = counted
    assert model.encode_many(texts) == [tok.encode(t) for t in texts]
    assert model.encode_many(["hello world"]) == [tok.encode("hello world")]
    assert model.encode_many([]) == []
    assert calls == [len(texts), 1]  # one call per batch, none for no texts
