"""Speculative decoding in the cost model (course.sim.speculative): tokens per step, step costs, speed-up."""

import numpy as np
import pytest

from course import hardware, kv
from course.sim import RooflineCost
from course.sim import speculative as S

LLAMA = kv.get_model("Llama-3.1-8B")
H100 = RooflineCost(LLAMA, hardware.gpu("H100-SXM"))


@pytest.mark.parametrize(
    ("k", "a", "want"), [(0, 0.7, 1.0), (4, 0.0, 1.0), (4, 1.0, 5.0), (4, 0.8, 3.3616), (2, 0.5, 1.75)]
)
def test_expected_tokens_is_leviathans_equation_one(k, a, want):
    assert S.expected_tokens(k, a) == pytest.approx(want)


def test_expected_tokens_agrees_with_drawing_the_acceptances():
    """The closed form against the process it describes: accept draft tokens until the first rejection,
    then the target's own token (the bonus) comes for free."""
    rng = np.random.default_rng(0)
    for k, a in [(3, 0.6), (5, 0.9), (1, 0.3)]:
        accepted = rng.random((200_000, k)) < a
        run = np.where(accepted.all(axis=1), k, np.argmin(accepted, axis=1))  # leading accepted tokens
        assert (run + 1).mean() == pytest.approx(S.expected_tokens(k, a), rel=0.01)


def test_verification_costs_about_one_decode_step_at_batch_one_and_k_plus_one_at_a_large_batch():
    one = S.speculate(H100, 1, 1000, 4, 0.8)
    assert one.verify == pytest.approx(one.decode, rel=0.02)  # bandwidth-bound: the weights dominate
    many = S.speculate(H100, 1024, 200, 4, 0.8)
    assert many.verify / many.decode == pytest.approx(5, rel=0.05)  # compute-bound: 5x the FLOPs


def test_the_speedup_is_nearly_the_tokens_per_step_alone_and_vanishes_at_large_batch():
    curve = S.speedup_curve(H100, [1, 8, 64, 256, 1024], 200, 4, 0.8)
    assert curve[0].speedup == pytest.approx(S.expected_tokens(4, 0.8), rel=0.03)
    speedups = [c.speedup for c in curve]
    assert all(later <= earlier + 1e-9 for earlier, later in zip(speedups, speedups[1:]))
    assert speedups[-1] < 1  # verification costs more than the accepted tokens save
    edge = S.break_even_batch(H100, 200, 4, 0.8)
    assert edge is not None and S.speculate(H100, edge, 200, 4, 0.8).speedup <= 1
    assert S.speculate(H100, edge // 2, 200, 4, 0.8).speedup > 1


def test_long_contexts_keep_the_step_bandwidth_bound_as_far_as_the_cache_reaches():
    """At 2,000 tokens of context the KV reads, which the k + 1 tokens share, keep the step bandwidth-bound
    up to the largest batch an H100's cache holds: the speed-up stays."""
    cache_tokens = kv.budget(LLAMA, "H100-SXM", utilization=0.9, max_model_len=8192).num_blocks * 16
    largest = cache_tokens // 2000
    assert S.speculate(H100, largest, 2000, 4, 0.8).speedup > 0.9 * S.expected_tokens(4, 0.8)


def test_a_draft_model_costs_k_of_its_steps():
    draft = RooflineCost(kv.get_model("Qwen2.5-0.5B-Instruct"), hardware.gpu("H100-SXM"))
    with_draft = S.speculate(H100, 1, 1000, 4, 0.8, draft_cost=draft)
    assert with_draft.draft == pytest.approx(4 * S.decode_seconds(draft, 1, 1000))
    assert with_draft.speedup < S.speculate(H100, 1, 1000, 4, 0.8).speedup


@pytest.mark.parametrize(("k", "a"), [(-1, 0.5), (2, 1.5), (2, -0.1), (1.5, 0.5)])
def test_bad_settings_are_refused(k, a):
    with pytest.raises(ValueError):
        S.expected_tokens(k, a)
    with pytest.raises(ValueError, match="batch"):
        S.decode_seconds(H100, 0, 10)
