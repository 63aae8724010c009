import pytest

from common.tokenization import load_tokenizer
from loadgen.errors import PromptError
from loadgen.prompts import PromptBuilder, common_prefix_length
from loadgen.synthetic import SyntheticConfig, generate

from .builders import make_request

pytestmark = pytest.mark.unit


def test_byte_level_prompts_through_the_worker_tokenizer():
    tokenizer, _ = load_tokenizer(None)
    builder = PromptBuilder()
    a = make_request([0, 1, 2], 1400, block_size=512)
    b = make_request([0, 1, 7, 8], 1800, block_size=512)
    c = make_request([0, 1, 2, 3], 2048, block_size=512)
    ta, tb, tc = (tokenizer.encode(builder.prompt(r)) for r in (a, b, c))
    assert (len(ta), len(tb), len(tc)) == (1400, 1800, 2048)
    # equal ids -> equal token prefix; the first different id differs from its first token
    assert common_prefix_length(ta, tb) == 1024
    # a's partial last block (id 2, 376 tokens) is a prefix of c's full block 2
    assert common_prefix_length(ta, tc) == 1400
    assert PromptBuilder().prompt(a) == builder.prompt(a)  # deterministic across builders


def test_sibling_ids_differ_from_their_first_token():
    tokenizer, _ = load_tokenizer(None)
    builder = PromptBuilder()
    firsts = {}
    for block_id in range(1, 201):
        ids = tokenizer.encode(builder.prompt(make_request([0, block_id], 600, block_size=512)))
        firsts[block_id] = ids[512]
        # never equal for a whole 16-token worker block
        assert ids[512:528] != tokenizer.encode(builder.prompt(make_request([0, block_id + 1000], 600)))[512:528]
    # with 64 letters, 200 ids cover most of them; a pair shares a first token with probability 1/64
    assert len(set(firsts.values())) >= 55


def test_namespaces_give_different_text_for_equal_ids():
    builder = PromptBuilder()
    x = builder.prompt(make_request([1, 2], 128, block_size=64, namespace="trace_0001"))
    y = builder.prompt(make_request([1, 2], 128, block_size=64, namespace="trace_0002"))
    assert x != y and len(x) == len(y) == 128


def test_agentic_plus_minus_one_blocks():
    builder = PromptBuilder()
    assert builder.block_token_counts(make_request([1, 2, 3], 100, block_size=64)) == [64, 36, 0]
    assert builder.block_token_counts(make_request([1], 100, block_size=64)) == [100]
    assert len(builder.prompt(make_request([1, 2, 3], 100, block_size=64))) == 100
    with pytest.raises(PromptError, match="without hash_ids"):
        builder.prompt(make_request([], 10))


def test_synthetic_turns_extend_each_other_as_text():
    reqs = generate(SyntheticConfig(num_sessions=2, num_turns=4, system_prompt_tokens=100, seed=3))
    builder = PromptBuilder(verify=True)
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    assert sorted(by_session) == ["syn0", "syn1"]
    for turns in by_session.values():
        texts = [builder.prompt(r) for r in turns]
        for earlier, later in zip(texts, texts[1:], strict=False):
            assert later.startswith(earlier)
    s0, s1 = by_session["syn0"][0], by_session["syn1"][0]
    # the system prompt's one full block is shared, the partial one (100 - 64 = 36 tokens) is per session
    assert s0.hash_ids[0] == s1.hash_ids[0] == 0 and s0.hash_ids[1] != s1.hash_ids[1]
    assert common_prefix_length(builder.prompt(s0).encode(), builder.prompt(s1).encode()) in range(64, 67)


def make_bpe_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [f"w{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x" for i in range(400)]
    corpus = [" ".join(words[i : i + 20]) for i in range(0, 400, 5)] * 5
    corpus += ["the quick brown fox jumps over the lazy dog " * 3, "alpha beta gamma delta epsilon zeta eta theta"] * 20
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_json_prompts_have_exact_counts(tmp_path):
    path = make_bpe_tokenizer(tmp_path)
    builder = PromptBuilder(path)  # verifies every prompt by encoding it
    tokenizer, _ = load_tokenizer(path)
    a = make_request([5, 6, 7], 150, block_size=64)
    b = make_request([5, 6, 9], 192, block_size=64)
    ta, tb = tokenizer.encode(builder.prompt(a)), tokenizer.encode(builder.prompt(b))
    assert (len(ta), len(tb)) == (150, 192)
    assert 128 <= common_prefix_length(ta, tb) <= 129


def test_tokenizer_json_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(PromptError, match="cannot load tokenizer"):
        PromptBuilder(bad)
