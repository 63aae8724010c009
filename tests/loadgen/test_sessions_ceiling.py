import pytest

from loadgen.ceiling import ceiling, lru_bound, served_ceiling
from loadgen.sessions import derive_sessions, shared_head_length

from .builders import BUNDLED_TRACE, make_record, make_request

pytestmark = pytest.mark.unit


def test_sessions_continue_beyond_shared_head_only():
    reqs = [
        make_request([0, 1, 2]),  # s0
        make_request([0, 3, 4]),  # shares only the head [0]: new session s1
        make_request([0, 1, 2, 5]),  # extends the first: s0
        make_request([0, 3]),  # shares [0, 3] with the second: s1
        make_request([0, 1, 9]),  # shares [0, 1]; the latest request through block 1 is the third: s0
        make_request([0, 7]),  # head only: s2
    ]
    assert shared_head_length(reqs) == 1
    assert [r.session_id for r in derive_sessions(reqs)] == ["s0", "s1", "s0", "s1", "s0", "s2"]


def test_sessions_without_shared_head_and_namespaces():
    reqs = [
        make_request([1, 2]),
        make_request([3, 4]),
        make_request([1, 2, 5]),
        make_request([1, 2], namespace="other"),  # same ids in another namespace share nothing
    ]
    assert shared_head_length(reqs) == 0
    assert [r.session_id for r in derive_sessions(reqs, prefix="c")] == ["c0", "c1", "c0", "c2"]


def test_real_trace_does_not_make_one_giant_session():
    from loadgen.traces import read_mooncake

    reqs = derive_sessions(read_mooncake(BUNDLED_TRACE, max_requests=1000))
    sizes: dict[str, int] = {}
    for r in reqs:
        sizes[r.session_id] = sizes.get(r.session_id, 0) + 1
    assert shared_head_length(reqs) == 1
    assert len(sizes) == 781
    assert max(sizes.values()) == 7


def test_ceiling_follows_the_readme_method():
    reqs = [
        make_request([0, 1], 1000),  # nothing seen: 0
        make_request([0, 2], 600),  # k=1: 512
        make_request([0, 1, 3], 1536),  # k=2: 1024
        make_request([0, 1], 1000),  # fully covered, partial tail included: 1000
        make_request([0], 300),  # k=1 on a 300-token prompt: min(512, 300) = 300
    ]
    bound = ceiling(reqs)
    assert bound.num_reused_tokens == 512 + 1024 + 1000 + 300
    assert bound.num_prompt_tokens == 1000 + 600 + 1536 + 1000 + 300
    assert bound.hit_ratio == pytest.approx(2836 / 4436)
    assert bound.num_distinct_blocks == 4
    assert bound.num_blocks == 10


def test_served_ceiling_leaves_out_failed_and_unsent_requests():
    reqs = [
        make_request([0, 1], 1000),  # served: 0
        make_request([2, 3], 1024),  # failed: neither counted nor cached
        make_request([2, 3, 4], 1536),  # served; [2, 3] was never cached, so 0 (the whole slice's walk says 1024)
        make_request([0, 1, 5], 1200),  # served: k=2, 1024
        make_request([0, 1], 1000),  # never sent (no record)
    ]
    records = [make_record(0), make_record(1, error="http_400"), make_record(3), make_record(2)]
    bound = served_ceiling(reqs, records)
    assert bound.num_reused_tokens == 0 + 0 + 1024
    assert bound.num_prompt_tokens == 1000 + 1536 + 1200
    assert bound.hit_ratio == 1024 / 3736
    assert (bound.num_distinct_blocks, bound.num_blocks) == (6, 8)
    assert ceiling(reqs).num_reused_tokens == 1024 + 1024 + 1000  # the whole slice, for contrast
    assert served_ceiling(reqs, []).hit_ratio == 0.0


def test_lru_bound_matches_ceiling_when_large_and_evicts_when_small():
    reqs = [
        make_request([0, 1]),
        make_request([2, 3]),
        make_request([0, 1]),
    ]
    assert lru_bound(reqs, 100).num_reused_tokens == ceiling(reqs).num_reused_tokens == 1024
    assert lru_bound(reqs, 0).num_reused_tokens == 0
    # capacity 2: the second request evicts 0 and 1
    assert lru_bound(reqs, 2).num_reused_tokens == 0
    # capacity 3: 0 was evicted (least recently used), so the third request matches nothing from the root
    assert lru_bound(reqs, 3).num_reused_tokens == 0
    assert lru_bound(reqs, 4).num_reused_tokens == 1024
    with pytest.raises(ValueError, match="capacity_blocks"):
        lru_bound(reqs, -1)


def test_real_slice_ceiling():
    from loadgen.traces import read_mooncake

    reqs = read_mooncake(BUNDLED_TRACE, max_requests=400)
    assert ceiling(reqs).hit_ratio == pytest.approx(0.137, abs=0.001)
