"""pyllama_pp.expert_cache_sim: each policy's hits on small hand-made traces, counted by hand below (the walk-through
of every step is in the comments), and Belady's optimum above every policy on random traces."""
from __future__ import annotations

import numpy as np
import pytest

from pyllama_pp.expert_cache_sim import POLICIES, hit_rates, simulate
from pyllama_pp.expert_trace import ExpertTrace


def one_layer(seq, n_expert=4) -> ExpertTrace:
    """A one-layer trace; seq: each token's ids (an int for k = 1)."""
    ids = np.array([s if np.ndim(s) else [s] for s in seq])[:, None, :]
    return ExpertTrace(ids, [0], n_expert)


# k = 1, 4 experts, a cache of 2 (fraction 0.5)
A = one_layer([0, 1, 0, 2, 0, 1, 3, 1, 0])
B = one_layer([0, 0, 0, 1, 2, 0, 1, 2, 0])


def hits(trace, policy, fraction=0.5, warmup=0, **kw) -> int:
    return simulate(trace, fraction, policy, warmup=warmup, **kw)["hits"]


def test_lru_by_hand():
    # A: 0 m [0] | 1 m [0 1] | 0 H [1 0] | 2 m ev 1 [0 2] | 0 H [2 0] | 1 m ev 2 [0 1] | 3 m ev 0 [1 3] | 1 H [3 1]
    #    | 0 m ev 3
    assert hits(A, "lru") == 3
    # B: 0 m | 0 H | 0 H | 1 m [0 1] | 2 m ev 0 [1 2] | 0 m ev 1 | 1 m ev 2 | 2 m ev 0 | 0 m ev 1
    assert hits(B, "lru") == 2
    # a warm-up: A's first 3 tokens run uncounted, then 2 m, 0 H, 1 m, 3 m, 1 H, 0 m -> 2 of 6
    r = simulate(A, 0.5, "lru", warmup=3)
    assert (r["hits"], r["lookups"], r["capacity"]) == (2, 6, 2)


def test_lfu_by_hand():
    # A (counts so far; ties to the least recently used): 0 m | 1 m [0:1 1:1] | 0 H (0:2) | 2 m: evict 1 (1 < 2)
    #   | 0 H (0:3) | 1 m (1:2): evict 2 (1) | 3 m: evict 1 (2 < 3) | 1 m (1:3): evict 3 (1) | 0 H
    assert hits(A, "lfu") == 3
    # B: 0 m | 0 H | 0 H (0:3) | 1 m [0 1] | 2 m: evict 1 | 0 H | 1 m (1:2): evict 2 | 2 m (2:2): evict 1 | 0 H
    assert hits(B, "lfu") == 4


def test_aged_lfu_by_hand():
    # B with a half-life of 1 token (scores halve every token): 0 m | 0 H (1.5) | 0 H (1.75) | 1 m [0 1]
    #   | 2 m: 0 has 0.4375, 1 0.5 -> evict 0 | 0 m: 1 0.25, 2 0.5 -> evict 1 | 1 m: 2 0.25, 0 0.61 -> evict 2
    #   | 2 m: 0 0.305, 1 0.5625 -> evict 0 | 0 m  => 2 hits, as LRU
    assert hits(B, "lfu_aged", half_life=1.0) == 2
    # half-life 4 (x0.841 a token): ... | 2 m: 0 1.80, 1 0.84 -> evict 1 | 0 H | 1 m: 0 2.12, 2 0.71 -> evict 2
    #   | 2 m: 0 1.78, 1 1.34 -> evict 1 | 0 H  => 4 hits, as LFU
    assert hits(B, "lfu_aged", half_life=4.0) == 4


def test_static_by_hand():
    # the list: the warm-up's most used experts. A: 0, 1, 0 -> [0, 1]; then 2 0 1 3 1 0 -> 4 hits
    assert hits(A, "static", warmup=3) == 4
    # B: 0, 0, 0 -> [0] only (1 never seen); then 1 2 0 1 2 0 -> 2 hits
    assert hits(B, "static", warmup=3) == 2
    assert hits(A, "static", warmup=0) == 0   # (no warm-up, no list)


def test_belady_by_hand():
    # starts with the first 2 experts looked up. A: [0 1]: 0 H 1 H 0 H | 2 m: next 0 @4, 1 @5, 2 never -> not inserted
    #   | 0 H 1 H | 3 m: next 0 @8, 1 @7, 3 never -> not inserted | 1 H 0 H  => 7
    assert hits(A, "belady") == 7
    # B: [0 1]: 0 H 0 H 0 H 1 H | 2 m: next 1 @6, 2 @7 -> not inserted | 0 H 1 H | 2 m: 1 never, 2 never -> not
    #   inserted | 0 H  => 7
    assert hits(B, "belady") == 7
    # a cache of 1 on A: [0]: 0 H | 1 m: next 0 @2, 1 @5 -> no | 0 H | 2 m (never) | 0 H | 1 m: 0 @8, 1 @7 -> evict 0
    #   | 3 m (never) | 1 H | 0 m  => 4
    assert hits(A, "belady", fraction=0.25) == 4


def test_lru2_by_hand():
    # B (each entry's lookup before its last, by token 1..9; -: none): 0 m | 0 H | 0 H (0: 2) | 1 m [0 1]
    #   | 2 m: 0 @2, 1 - -> evict 1 | 0 H (0: 3) | 1 m (1: 4): 0 @3, 2 - -> evict 2 | 2 m (2: 5): 0 @3, 1 @4 -> evict 0
    #   | 0 m  => 3 (LRU: 2)
    assert hits(B, "lru2") == 3


def test_slru_by_hand():
    # B, 2 slots, protected 2 (round(0.8 * 2)): 0 m P[0] | 0 H -> S[0] | 0 H | 1 m P[1] | 2 m: evict P's 1, P[2] | 0 H
    #   | 1 m: evict 2 | 2 m: evict 1 | 0 H  => 4 (the protected 0 outlives the one-off misses; LRU: 2)
    assert hits(B, "slru") == 4
    # 3 of 4 experts, protected 2: 0 1 2 m P[0 1 2] | 0 H 1 H S[0 1] | 2 H: S[0 1 2] overflows, 0 back to P[0]
    #   | 3 m: evict P's 0, P[3] | 0 m: evict 3 | 1 H 2 H  => 5 (LRU: 3 H, then 3 evicts 0, 0 evicts 1, 1 evicts 2)
    d = one_layer([0, 1, 2, 0, 1, 2, 3, 0, 1, 2])
    assert (hits(d, "slru", fraction=0.75), hits(d, "lru", fraction=0.75)) == (5, 3)


def test_2q_by_hand():
    # 4 of 8 experts: Kin 1, Kout 2. 0 1 2 3 m in[0 1 2 3] | 0 H (in A1in: stays) | 4 m: in over Kin, evict 0
    #   out[0] in[1 2 3 4] | 5 m: evict 1, out[0 1] | 0 m, in A1out: evict 2, out[1 2], m[0] in[3 4 5]
    #   | 6 m: evict 3, out[2 3] (1 falls out) | 1 m (not a ghost now): evict 4, out[3 4], in[5 6 1] | 7 m: evict 5,
    #   out[4 5] | 0 H (Am) | 4 m, in A1out: evict 6, m[0 4]  => 2 (LRU: 3)
    e = one_layer([0, 1, 2, 3, 0, 4, 5, 0, 6, 1, 7, 0, 4], n_expert=8)
    assert (hits(e, "2q"), hits(e, "lru")) == (2, 3)
    # B, 2 slots: Kin 0, Kout 1. 0 m in[0] | 0 H | 0 H | 1 m in[0 1] | 2 m: evict 0 to out[0] | 0 m, a ghost: evict 1
    #   to out[1], m[0] | 1 m, a ghost: evict 2 to out[2], m[0 1] | 2 m, a ghost: A1in empty, evict Am's 0 | 0 m  => 2
    assert hits(B, "2q") == 2


def test_arc_by_hand():
    # B, 2 slots, p = 0: 0 m T1[0] | 0 H T2[0] | 0 H | 1 m T1[1] | 2 m: |T1| 1 > p, evict 1 to B1, T1[2] | 0 H
    #   | 1 m in B1: p 1; |T1| 1 = p, evict T2's 0 to B2, T2[1] | 2 H: T2[1 2] | 0 m in B2: p 0, evict T2's 1  => 4
    assert hits(B, "arc") == 4
    # A: 0 1 m T1[0 1] | 0 H T2[0] | 2 m: evict 1 to B1, T1[2] | 0 H | 1 m in B1: p 1, evict T2's 0 to B2, T2[1]
    #   | 3 m (|T1| + |B1| = 1): |T1| 1 = p, evict T2's 1 to B2[0 1], T1[2 3] | 1 m in B2: p 0, evict T1's 2, T2[1]
    #   | 0 m in B2: evict T1's 3  => 2 (LRU: 3)
    assert hits(A, "arc") == 2


def test_tinylfu_by_hand():
    # B, 2 slots (counts halve every 20 lookups: none here): 0 m | 0 H | 0 H (0: 3) | 1 m [0 1] | 2 m (2: 1): the
    #   LRU victim 0 has 3, not admitted | 0 H | 1 H | 2 m (2: 2) against 0's 4: not admitted | 0 H  => 5 (LRU: 2)
    assert hits(B, "tinylfu") == 5
    # 1 slot, counts halve every 10 lookups: 0 x10 (9 H; 0: 10, halved to 5 after the 10th), then 1 x7: 1's counts
    #   1..5 are not above 5, the 6th (6) replaces 0, the 7th hits  => 10 (LRU: 15; without the halving, 9)
    t = one_layer([0] * 10 + [1] * 7)
    assert (hits(t, "tinylfu", fraction=0.25), hits(t, "lru", fraction=0.25)) == (10, 15)


ONLINE = [p for p in POLICIES if p not in ("static", "belady")]


@pytest.mark.parametrize("policy", ONLINE)
def test_a_steps_experts_never_evict_each_other(policy):
    # 1 slot: 0 m goes in, 1 m finds only this step's 0 to evict: not inserted | 0 H, 2 m not inserted  => 1
    assert hits(one_layer([[0, 1], [0, 2]]), policy, fraction=0.25) == 1


def test_a_tokens_experts_are_looked_up_together():
    """k = 2: a hit is decided at the step's start, and a step's misses never evict its own experts."""
    t = one_layer([[0, 1], [2, 0], [1, 2]])
    # LRU, 2 slots: [0 1] | 2 m, 0 H: touch 0, insert 2 evicting 1 (not 0: this step's) [0 2] | 1 m, 2 H: evict 0
    # (looked up one by one, 2's insertion would evict 0 before its lookup: 0 hits)
    assert hits(t, "lru") == 2
    # 1 slot: [0] (1 not inserted: only this step's 0 to evict) | 0 H, 2 not inserted | 1 m evicts 0, 2 not inserted
    assert hits(t, "lru", fraction=0.25) == 1


def test_layers_are_separate_caches():
    ids = np.stack([A.ids[:, 0, :], B.ids[:, 0, :]], axis=1)
    r = simulate(ExpertTrace(ids, [3, 5], 4), 0.5, "lru", warmup=0)
    assert r["per_layer"] == [3, 2] and r["hits"] == 5 and r["lookups"] == 18


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_the_ceiling(seed):
    g = np.random.default_rng(seed)
    # a sticky random trace: each token keeps most of the previous token's experts
    E, k, T = 16, 3, 80
    rows, cur = [], list(g.choice(E, k, replace=False))
    for _ in range(T):
        if g.random() < 0.5:
            out = int(g.integers(k))
            cur[out] = int(g.choice([e for e in range(E) if e not in cur]))
        rows.append(list(cur))
    tr = ExpertTrace(np.array(rows)[:, None, :], [0], E)
    df = hit_rates(tr, (0.125, 0.25, 0.5), warmup=20)
    for f, g_ in df.groupby("fraction"):
        best = g_.set_index("policy").hits
        assert (best.drop("belady") <= best["belady"]).all(), (f, best.to_dict())
    assert set(df.policy) == set(POLICIES)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown cache policy"):
        simulate(A, 0.5, "fifo")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        simulate(A, 1.5, "lru")
    with pytest.raises(ValueError, match="warmup"):
        simulate(A, 0.5, "lru", warmup=99)
