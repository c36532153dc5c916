"""Hit rates of a per-layer expert cache, simulated on a recorded trace of routing decisions.

A decode step with experts in host RAM either computes the used experts on the host CPU or fetches them to the
device. A per-device cache of the most useful expert slices of each host-expert layer removes the share of that
work it hits. Whether it pays depends on the routing's temporal locality, which this module measures on a trace
(:class:`~pyllama_pp.expert_trace.ExpertTrace`, from ``pyllama-pp trace``: expert ids [tokens, layers, k]) for several policies and cache sizes. Published anchors:
llama.cpp PR #27861 (a per-layer GPU LRU of CPU-held experts; on a 512-expert model a per-layer LRU of 64 experts,
12.5%, hits ~67% and of 128 ~81%, while a static top-32 list covers ~10% of the traffic), flash-moe (a
frequency-weighted LRU, ~95% hits), qvac-fabric-llm.cpp #232 (one global LRU over slots), and Eliseev & Mazur,
"Fast Inference of Mixture-of-Experts Language Models with Offloading" (2023: LRU caching of Mixtral's experts).

The model (every policy follows it; the native cache implements the same LRU, so its hit counters can be compared
with :func:`simulate` on a known trace):

- Each MoE layer has its own cache of ``capacity = round(fraction * n_expert)`` experts; layers never share.
- A **lookup** is one (token, layer, expert id) of the trace; a token's k ids at a layer form one **step**.
  Tokens are taken in trace order. Ids below 0 (a row the trace lacks) are no lookups.
- A lookup is a **hit** when the expert is in the layer's cache at the start of its step (a token's experts are
  looked up together, before the step changes the cache).
- Then the step updates the cache: first its hits are touched, in slot order (the trace's order of the k ids), then
  its misses are inserted, in slot order. Every touch or insertion takes the next value of one global counter,
  the entry's *recency* (larger = more recently used).
- Inserting into a full cache evicts a **victim**, chosen by the policy among the entries that the current step did
  not look up (a token's experts never evict each other); where there is none (capacity <= the step's hits), the
  miss is not inserted. Belady's optimum may evict any entry and may decline an insertion (see below).
- Hits are counted only after a **warm-up**: the first ``warmup`` tokens run through every cache (and pick the
  static list) without being counted.

Policies (``POLICIES``):

``lru``     evict the least recently used entry (smallest recency).
``lfu``     evict the entry with the fewest lookups so far (counted for every expert of the layer since the trace
            began, cached or not: "perfect" LFU); ties go to the least recently used.
``lfu_aged`` LFU with ageing, the LFU/LRU mix: each lookup adds 1 to the expert's score, and every score halves
            every ``half_life`` tokens (a score of sum 2 ** (-(t_now - t_lookup) / half_life)). A short half-life
            approaches LRU, an infinite one LFU; evict the lowest score, ties to the least recently used.
``lru2``    LRU-K with K = 2 (O'Neil, O'Neil & Weikum, 1993): evict the entry whose second-to-last lookup (its token;
            every expert's last two lookups are kept, cached or not) is oldest; entries looked up only once go first,
            ties to the least recently used.
``slru``    segmented LRU (Karedla, Love & Wherry, 1994): a miss enters a probationary segment, a hit moves its entry
            to the most recent end of a protected segment of ``SLRU_PROTECTED`` of the capacity, whose least recent
            entry, when it overflows, goes back to the probationary segment's most recent end; evict the
            probationary segment's least recent entry, else the protected segment's.
``2q``      full 2Q (Johnson & Shasha, 1994): a miss enters a FIFO, A1in, where a hit leaves it in place; evict A1in's
            oldest entry while A1in holds more than ``TWOQ_IN`` of the capacity (its id then joins A1out, a FIFO of
            ``TWOQ_OUT`` of the capacity of ids not cached), else the least recent of an LRU, Am; a miss whose id is
            in A1out enters Am, and a hit in Am moves to its most recent end.
``arc``     ARC, the Adaptive Replacement Cache (Megiddo & Modha, 2003): LRU lists T1 (entries looked up once since
            they entered) and T2 (more often) with ghost lists B1 and B2 of the ids each evicted, and T1's target
            size p (from 0). A hit moves its entry to T2; a miss in B1 raises p by max(|B2| / |B1|, 1) (in B2: lowers
            it by max(|B1| / |B2|, 1)), within [0, capacity], and enters T2; another miss enters T1. The victim is
            T1's least recent entry where |T1| > p (or = p, for a miss in B2), else T2's, and its id joins B1 or B2;
            the ghost lists are kept as the paper's algorithm keeps them (|T1| + |B1| at most the capacity: a new id
            finding it full drops B1's oldest id, or, with B1 empty, evicts T1's least recent entry without a ghost;
            all four lists at most twice the capacity: else a new id drops B2's oldest).
``tinylfu`` LRU behind TinyLFU's admission filter (Einziger, Friedman & Manes, 2017): each expert's lookups are
            counted (cached or not), and every count halves (integer division) after the step that brings the
            lookups since the last halving to ``TINYLFU_SAMPLE`` times the capacity; a miss in a full cache replaces
            the LRU victim only if its count (this lookup included) is larger than the victim's, else it is not
            inserted.
``static``  a fixed list: the ``capacity`` experts looked up most often in the warm-up (ties to the lower id), never
            changed; nothing is inserted (empty without a warm-up).
``belady``  the offline optimum (Belady's MIN with bypass), the ceiling of every policy of this model: it starts
            the counted part with the best content it could have (the ``capacity`` experts first looked up there),
            and on a miss in a full cache evicts the entry - any entry, this step's hits too - whose next lookup
            (after this token) is farthest away, unless the missed expert's own next lookup is at least as far, in
            which case it is not inserted. Ties (e.g. entries never looked up again) go to the least recently used.

Where the list that slru, 2q or arc evicts from holds only this step's experts, the victim comes from its other list.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

import numpy as np

from .expert_trace import ExpertTrace

__all__ = ["POLICIES", "DEFAULT_FRACTIONS", "DEFAULT_HALF_LIFE", "GUARD_WINDOW", "GUARD_MARGIN", "simulate",
           "cached_before", "hit_rates", "guard", "link_share", "hybrid", "locality_summary"]

POLICIES = ("lru", "lfu", "lfu_aged", "lru2", "slru", "2q", "arc", "tinylfu", "static", "belady")
#: cache sizes as a fraction of each layer's experts (1/16, 1/8, 1/4, 3/8, 1/2)
DEFAULT_FRACTIONS = (0.0625, 0.125, 0.25, 0.375, 0.5)
#: lfu_aged's half-life in tokens
DEFAULT_HALF_LIFE = 16.0
#: the native cache's hit-rate guard (EXPERT_CACHE_MIN_HIT, patch 0014; GGML_SCHED_PP_CACHE_GUARD_WINDOW and _MARGIN
#: in ggml-backend-pp-cache.cpp): the tokens whose shadow hits decide, and the points above the floor at which a layer
#: returns to its cache
GUARD_WINDOW = 32
GUARD_MARGIN = 10
#: slru's protected segment, 2q's A1in and A1out (each a share of the capacity; the 2Q paper's Kin and Kout), and
#: tinylfu's sample (its counts halve every this many lookups per cached expert: TinyLFU's W = 10 C)
SLRU_PROTECTED = 0.8
TWOQ_IN = 0.25
TWOQ_OUT = 0.5
TINYLFU_SAMPLE = 10


def capacity_of(fraction: float, n_expert: int) -> int:
    """The experts a layer's cache holds for a fraction of its experts (rounded to the nearest)."""
    return int(round(fraction * n_expert))


def _next_use(steps: Sequence[np.ndarray], n_expert: int) -> np.ndarray:
    """[T + 1, n_expert]: the first token index >= t that looks the expert up (T: never)."""
    T = len(steps)
    nxt = np.full((T + 1, n_expert), T, dtype=np.int64)
    for t in range(T - 1, -1, -1):
        nxt[t] = nxt[t + 1]
        nxt[t, steps[t]] = t
    return nxt


def _online(policy: str, capacity: int, n_expert: int, half_life: float) -> "_Policy":
    """One layer's cache under an online policy."""
    if policy in ("lru", "lfu", "lfu_aged"):
        return _Cache(capacity, policy, n_expert, half_life)
    if policy in ("lru2", "tinylfu"):
        return (_LRU2 if policy == "lru2" else _TinyLFU)(capacity, n_expert)
    return {"slru": _SLRU, "2q": _TwoQ, "arc": _ARC}[policy](capacity)


def _first_not(entries: Iterable[int], here: set) -> Optional[int]:
    """The first of `entries` (least recently used / oldest first) that this step did not look up, or None."""
    return next((e for e in entries if e not in here), None)


def _first_in(queues, here: set):
    """(queue, entry): the first entry not looked up in this step of the first queue that has one, or (None, None)."""
    return next(((q, v) for q in queues for v in [_first_not(q, here)] if v is not None), (None, None))


def _min_not(recency: "OrderedDict[int, int]", here: set, key) -> Optional[int]:
    """The entry of smallest key(expert, recency) that this step did not look up, or None."""
    best, best_key = None, None
    for e, r in recency.items():
        if e in here:
            continue
        k = key(e, r)
        if best_key is None or k < best_key:
            best, best_key = e, k
    return best


class _Policy:
    """One layer's cache under an online policy, a step (a token's ids) at a time, as the module's model says: the
    step's hits are those cached at its start; then its hits are touched and its misses inserted, in slot order. A
    policy says what a lookup records (`_looked_up`, before the touches; `_stepped`, after the step), what a hit does
    (`_hit`) and how a miss goes in (`_miss`: evicting a victim not in `here`, or declining)."""

    def __init__(self, capacity: int):
        self.capacity, self.clock = capacity, 0

    def __contains__(self, e: int) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def full(self) -> bool:
        return len(self) >= self.capacity

    def tick(self) -> int:
        """The next value of the recency counter."""
        self.clock += 1
        return self.clock

    def step(self, ids: Iterable[int]) -> int:
        """The step's hits (cached at its start); then its hits are touched and its misses inserted, in slot order."""
        ids = [int(e) for e in ids]
        hit_ids = [e for e in ids if e in self]
        self._looked_up(ids)
        for e in hit_ids:
            self._hit(e)
        here = set(ids)
        for e in ids:
            if e not in self:
                self._miss(e, here)
        self._stepped()
        return len(hit_ids)

    def _looked_up(self, ids: list) -> None:
        pass

    def _stepped(self) -> None:
        pass

    def _hit(self, e: int) -> None:
        raise NotImplementedError

    def _miss(self, e: int, here: set) -> None:
        raise NotImplementedError


class _Cache(_Policy):
    """lru, lfu, lfu_aged (and lru2, tinylfu below): one recency-ordered set, the victim by the policy's key. Its LRU
    is the native cache's slots and its guard's shadow of them."""

    def __init__(self, capacity: int, policy: str = "lru", n_expert: int = 0, half_life: float = DEFAULT_HALF_LIFE):
        super().__init__(capacity)
        self.policy = policy
        self.recency: "OrderedDict[int, int]" = OrderedDict()   # cached expert -> recency, least recent first
        self.counts = np.zeros(n_expert, dtype=np.float64) if policy in ("lfu", "lfu_aged") else None
        self.decay = 0.5 ** (1.0 / half_life) if policy == "lfu_aged" else 1.0

    def __contains__(self, e: int) -> bool:
        return e in self.recency

    def __len__(self) -> int:
        return len(self.recency)

    def _looked_up(self, ids: list) -> None:
        if self.decay != 1.0:
            self.counts *= self.decay
        if self.counts is not None:
            self.counts[ids] += 1.0

    def _hit(self, e: int) -> None:
        self.recency[e] = self.tick()
        self.recency.move_to_end(e)

    def _miss(self, e: int, here: set) -> None:
        if self.full:
            victim = self._victim(here)
            if victim is None or not self._admit(e, victim):
                return
            del self.recency[victim]
        self.recency[e] = self.tick()

    def _victim(self, here: set) -> Optional[int]:
        """The entry to evict (not one of this step's experts), or None."""
        if self.counts is None:
            return _first_not(self.recency, here)
        return _min_not(self.recency, here, lambda e, r: (self.counts[e], r))

    def _admit(self, e: int, victim: int) -> bool:
        return True


class _LRU2(_Cache):
    """lru2: LRU-K with K = 2, the victim by its second-to-last lookup."""

    def __init__(self, capacity: int, n_expert: int):
        super().__init__(capacity, "lru2")
        self.t = 0
        self.last = np.full(n_expert, -1, dtype=np.int64)   # the token of each expert's last lookup (-1: none)
        self.prev = np.full(n_expert, -1, dtype=np.int64)   # ... and of the one before it

    def _looked_up(self, ids: list) -> None:
        self.t += 1
        self.prev[ids] = self.last[ids]
        self.last[ids] = self.t

    def _victim(self, here: set) -> Optional[int]:
        return _min_not(self.recency, here, lambda e, r: (self.prev[e], r))


class _TinyLFU(_Cache):
    """tinylfu: LRU whose victim a missed expert replaces only when its recent lookups outnumber the victim's."""

    def __init__(self, capacity: int, n_expert: int, sample: int = TINYLFU_SAMPLE):
        super().__init__(capacity, "tinylfu")
        self.counts = np.zeros(n_expert, dtype=np.int64)
        self.window, self.added = max(1, sample * capacity), 0

    def _looked_up(self, ids: list) -> None:
        self.counts[ids] += 1
        self.added += len(ids)

    def _stepped(self) -> None:
        if self.added >= self.window:   # (TinyLFU's reset: every count halves)
            self.counts //= 2
            self.added = 0

    def _victim(self, here: set) -> Optional[int]:
        return _first_not(self.recency, here)

    def _admit(self, e: int, victim: int) -> bool:
        return bool(self.counts[e] > self.counts[victim])


class _Lists(_Policy):
    """A policy whose cached entries are split over several lists (expert -> recency, least recent / oldest first)."""

    def __init__(self, capacity: int, n_lists: int):
        super().__init__(capacity)
        self.lists = tuple(OrderedDict() for _ in range(n_lists))

    def __contains__(self, e: int) -> bool:
        return any(e in q for q in self.lists)

    def __len__(self) -> int:
        return sum(len(q) for q in self.lists)

    def move(self, e: int, dest: "OrderedDict[int, int]") -> None:
        """Puts e at dest's most recent end, out of any other list."""
        for q in self.lists:
            q.pop(e, None)
        dest[e] = self.tick()


class _SLRU(_Lists):
    """slru: a probationary and a protected LRU segment."""

    def __init__(self, capacity: int, protected: float = SLRU_PROTECTED):
        super().__init__(capacity, 2)
        self.limit = int(round(protected * capacity))
        self.probation, self.protected = self.lists

    def _hit(self, e: int) -> None:
        self.move(e, self.protected)
        if len(self.protected) > self.limit:   # (the protected segment's least recent back to probation)
            d, _ = self.protected.popitem(last=False)
            self.probation[d] = self.tick()

    def _miss(self, e: int, here: set) -> None:
        if self.full:
            seg, victim = _first_in((self.probation, self.protected), here)
            if victim is None:
                return
            del seg[victim]
        self.probation[e] = self.tick()


class _TwoQ(_Lists):
    """2q: full 2Q, a FIFO of first lookups (A1in), a ghost FIFO of its evictions (A1out) and an LRU (Am)."""

    def __init__(self, capacity: int, k_in: float = TWOQ_IN, k_out: float = TWOQ_OUT):
        super().__init__(capacity, 2)
        self.k_in, self.k_out = int(round(k_in * capacity)), int(round(k_out * capacity))
        self.a1in, self.am = self.lists
        self.a1out: "OrderedDict[int, int]" = OrderedDict()   # ghosts (not cached), oldest first

    def _hit(self, e: int) -> None:
        if e in self.am:   # (a hit in A1in leaves it where its first lookup put it)
            self.move(e, self.am)

    def _miss(self, e: int, here: set) -> None:
        seg, victim = None, None
        if self.full:   # (A1in's oldest where A1in is over Kin, else Am's least recent)
            first_in = len(self.a1in) > self.k_in
            seg, victim = _first_in((self.a1in, self.am) if first_in else (self.am, self.a1in), here)
            if victim is None:
                return
        ghost = self.a1out.pop(e, None) is not None   # (looked up before the eviction adds to A1out)
        if victim is not None:
            del seg[victim]
            if seg is self.a1in:
                self.a1out[victim] = 0
                if len(self.a1out) > self.k_out:
                    self.a1out.popitem(last=False)
        (self.am if ghost else self.a1in)[e] = self.tick()


class _ARC(_Lists):
    """arc: the Adaptive Replacement Cache, T1 / T2 cached, B1 / B2 their ghosts, p T1's adaptive target."""

    def __init__(self, capacity: int):
        super().__init__(capacity, 2)
        self.p = 0.0
        self.t1, self.t2 = self.lists
        self.b1: "OrderedDict[int, int]" = OrderedDict()   # ghosts (not cached), oldest first
        self.b2: "OrderedDict[int, int]" = OrderedDict()

    def _hit(self, e: int) -> None:
        self.move(e, self.t2)

    def _replace(self, e: int, here: set) -> bool:
        """Evict T1's or T2's least recent (not this step's) into its ghost list; False where none may go."""
        t1_first = len(self.t1) > 0 and (len(self.t1) > self.p or (e in self.b2 and len(self.t1) == self.p))
        seg, victim = _first_in((self.t1, self.t2) if t1_first else (self.t2, self.t1), here)
        if victim is None:
            return False
        del seg[victim]
        (self.b1 if seg is self.t1 else self.b2)[victim] = 0
        return True

    def _miss(self, e: int, here: set) -> None:
        c = self.capacity
        if e in self.b1 or e in self.b2:   # (a ghost: p moves towards its list, then the replacement)
            ghost, other = (self.b1, self.b2) if e in self.b1 else (self.b2, self.b1)
            step, p = max(len(other) / len(ghost), 1.0), self.p
            self.p = min(float(c), p + step) if ghost is self.b1 else max(0.0, p - step)
            if self.full and not self._replace(e, here):
                self.p = p
                return
            del ghost[e]
            self.t2[e] = self.tick()
            return
        if len(self.t1) + len(self.b1) >= c:
            if self.b1:
                if self.full and not self._replace(e, here):
                    return
                self.b1.popitem(last=False)
            else:   # (T1 is the whole cache: its least recent leaves without a ghost)
                victim = _first_not(self.t1, here)
                if victim is None:
                    return
                del self.t1[victim]
        elif self.full:
            if not self._replace(e, here):
                return
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)
        self.t1[e] = self.tick()


def _layer_hits(steps: list, n_expert: int, capacity: int, policy: str, warmup: int,
                half_life: float) -> int:
    """Hits of one layer's cache over the counted tokens (steps[t]: token t's ids in slot order, valid ones)."""
    T = len(steps)
    if capacity <= 0 or T <= warmup:
        return 0
    if policy == "static":
        counts = np.zeros(n_expert, dtype=np.int64)
        for ids in steps[:warmup]:
            counts[ids] += 1
        order = np.lexsort((np.arange(n_expert), -counts))   # most used first, ties to the lower id
        listed = np.zeros(n_expert, dtype=bool)
        listed[order[:capacity][counts[order[:capacity]] > 0]] = True
        return int(sum(int(listed[ids].sum()) for ids in steps[warmup:]))
    if policy == "belady":
        return _belady_hits(steps[warmup:], n_expert, capacity)
    cache = _online(policy, capacity, n_expert, half_life)
    return sum(h for t, h in enumerate(cache.step(ids) for ids in steps) if t >= warmup)


def _belady_hits(steps: list, n_expert: int, capacity: int) -> int:
    T = len(steps)
    nxt = _next_use(steps, n_expert)
    cache: dict = {}   # expert -> recency
    clock = 0
    for e in np.argsort(nxt[0], kind="stable")[:capacity]:   # the best start: the first looked up
        if nxt[0, e] < T:
            clock += 1
            cache[int(e)] = clock
    hits = 0
    for t, ids in enumerate(steps):
        hit_ids = [int(e) for e in ids if int(e) in cache]
        hits += len(hit_ids)
        for e in hit_ids:
            clock += 1
            cache[e] = clock
        for e in (int(e) for e in ids if int(e) not in cache):
            if len(cache) >= capacity:
                # farthest next lookup after this token, ties to the least recently used
                victim = max(cache, key=lambda c: (nxt[t + 1, c], -cache[c]))
                if nxt[t + 1, victim] <= nxt[t + 1, e]:
                    continue   # (bypass: the missed expert is needed no sooner than any entry)
                del cache[victim]
            clock += 1
            cache[e] = clock
    return hits


def _steps(trace: ExpertTrace, col: int) -> list:
    return [row[row >= 0] for row in trace.ids[:, col, :]]


def simulate(trace: ExpertTrace, fraction: float, policy: str, warmup: Optional[int] = None,
             half_life: float = DEFAULT_HALF_LIFE) -> dict:
    """One policy at one cache size over every MoE layer of a trace.

    Args:
        trace: the recorded routing.
        fraction: the cache's size as a fraction of each layer's experts (capacity = round(fraction * n_expert)).
        policy: one of POLICIES (the module docstring defines each).
        warmup: tokens run through the caches first without being counted (None: the trace's prompt, or a quarter
            of the tokens when it has none).
        half_life: lfu_aged's half-life in tokens.
    Returns:
        dict: policy, fraction, capacity, warmup, hits, lookups (counted ones), hit_rate, per_layer (hits per layer).
    Raises:
        ValueError: for an unknown policy, a fraction outside [0, 1], or a warm-up outside [0, tokens].
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; policies: {', '.join(POLICIES)}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"a cache fraction must be in [0, 1], got {fraction!r}")
    if not half_life > 0:
        raise ValueError(f"half_life must be > 0 tokens, got {half_life!r}")
    warmup = default_warmup(trace) if warmup is None else int(warmup)
    if not 0 <= warmup <= trace.n_tokens:
        raise ValueError(f"warmup must be in [0, {trace.n_tokens}] tokens, got {warmup}")
    capacity = capacity_of(fraction, trace.n_expert)
    per_layer = [_layer_hits(_steps(trace, c), trace.n_expert, capacity, policy, warmup, half_life)
                 for c in range(len(trace.layers))]
    lookups = int((trace.ids[warmup:] >= 0).sum())
    hits = int(sum(per_layer))
    return {"policy": policy, "fraction": float(fraction), "capacity": capacity, "warmup": warmup, "hits": hits,
            "lookups": lookups, "hit_rate": hits / lookups if lookups else float("nan"), "per_layer": per_layer}


def cached_before(trace: ExpertTrace, fraction: float, policy: str = "lru",
                  half_life: float = DEFAULT_HALF_LIFE) -> np.ndarray:
    """What each layer's cache held when each token looked its experts up (an online policy, as simulate() runs it):
    which of a token's experts missed, and which others a prefetch would have found cached.

    Args:
        trace: the recorded routing.
        fraction: the cache's size as a fraction of each layer's experts.
        policy: an online policy (not "static" or "belady").
        half_life: lfu_aged's half-life in tokens.
    Returns:
        np.ndarray: bool [tokens, layers, n_expert], True where the expert was cached at the token's start.
    Raises:
        ValueError: for a policy that is not online or a fraction outside [0, 1].
    """
    if policy not in POLICIES or policy in ("static", "belady"):
        raise ValueError(f"cached_before needs an online policy, not {policy!r}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"a cache fraction must be in [0, 1], got {fraction!r}")
    capacity = capacity_of(fraction, trace.n_expert)
    out = np.zeros((trace.n_tokens, len(trace.layers), trace.n_expert), dtype=bool)
    for c in range(len(trace.layers)):
        cache = _online(policy, capacity, trace.n_expert, half_life) if capacity > 0 else None
        for t, ids in enumerate(_steps(trace, c)):
            if cache is None:
                continue
            out[t, c] = [e in cache for e in range(trace.n_expert)]
            cache.step(ids)
    return out


def default_warmup(trace: ExpertTrace) -> int:
    """The trace's prompt, or a quarter of its tokens when it has none."""
    return trace.n_prompt if trace.n_prompt > 0 else trace.n_tokens // 4


def guard(trace: ExpertTrace, slots: int, min_hit: int, tokens_per_graph: int = 1, window: int = GUARD_WINDOW,
          margin: int = GUARD_MARGIN) -> dict:
    """The native cache's hit-rate guard (EXPERT_CACHE_MIN_HIT) on a trace decoded in graphs of `tokens_per_graph`
    tokens, every layer with `slots` slots (ggml-backend-pp-cache.cpp states the rule; this follows it):

    - each layer keeps a shadow LRU of `slots` experts that follows every token, and the real LRU (the slots) follows
      the tokens of the graphs its layer runs on the device;
    - a token whose step begins with the shadow full adds its shadow hits to the layer's window (its last `window`
      such tokens);
    - after each graph, once the window is full: a layer on the device whose window hit less than `min_hit` % of its
      lookups (window x k) leaves for the CPU, one on the CPU whose window hit `min_hit` + `margin` % or more returns;
      the next graph runs the layer where that leaves it. `min_hit` 0: never leaves.

    Returns:
        dict: per_layer_cpu (bool [tokens, layers]: where each token's expert ops ran), cached_tokens, cpu_tokens (token
        x layer pairs on each side), cached_graphs, cpu_graphs (graph x layer pairs: a layer's expert ops run once per
        graph), cpu_layers (on the CPU after the last decision), leaves, returns, shadow_hits, shadow_lookups, hits
        and lookups (the slots', over the cached tokens).
    Raises:
        ValueError: for fewer slots than a token's ids, a floor outside [0, 100], or tokens_per_graph < 1.
    """
    T, L, k = trace.ids.shape
    if slots < k or slots > trace.n_expert:
        raise ValueError(f"slots must be in [{k}, {trace.n_expert}] (a token's {k} ids .. every expert), got {slots}")
    if not 0 <= min_hit <= 100 or tokens_per_graph < 1:
        raise ValueError(f"min_hit must be in [0, 100] and tokens_per_graph >= 1, got {min_hit}, {tokens_per_graph}")
    on_cpu = np.zeros((T, L), dtype=bool)
    out = {"leaves": 0, "returns": 0, "shadow_hits": 0, "hits": 0, "cpu_graphs": 0, "cached_graphs": 0, "cpu_layers": 0}
    for c in range(L):
        steps = _steps(trace, c)
        shadow, slots_lru, seen, to_cpu = _Cache(slots), _Cache(slots), [], False
        for g0 in range(0, T, tokens_per_graph):
            out["cpu_graphs" if to_cpu else "cached_graphs"] += 1
            for t in range(g0, min(g0 + tokens_per_graph, T)):
                on_cpu[t, c] = to_cpu
                full = shadow.full
                h = shadow.step(steps[t])
                out["shadow_hits"] += h
                if full:
                    seen.append(h)
                if not to_cpu:
                    out["hits"] += slots_lru.step(steps[t])
            if len(seen) < window or min_hit == 0:
                continue
            hits = sum(seen[-window:])
            if not to_cpu and hits * 100 < min_hit * window * k:
                to_cpu, out["leaves"] = True, out["leaves"] + 1
            elif to_cpu and hits * 100 >= (min_hit + margin) * window * k:
                to_cpu, out["returns"] = False, out["returns"] + 1
        out["cpu_layers"] += int(to_cpu)
    valid = trace.ids >= 0
    return {"per_layer_cpu": on_cpu, "cached_tokens": int((~on_cpu).sum()), "cpu_tokens": int(on_cpu.sum()), **out,
            "shadow_lookups": int(valid.sum()), "lookups": int((valid & ~on_cpu[:, :, None]).sum())}


def link_share(misses: int, cpu_pct: int) -> int:
    """EXPERT_HYBRID's split of a token's misses at a layer (ggml_backend_sched_pp_hybrid_link_share states the rule):
    the link takes ceil(misses x 100 / (100 + cpu_pct)) of them - so that the link (k experts at R_link) and the host
    CPU (misses - k at R_cpu = cpu_pct / 100 x R_link) finish together, the rounding to the link, which takes at least
    one of a token's misses so that the slots keep following the routing (the CPU's misses are not cached) - and the
    CPU the rest; cpu_pct 0: the link takes them all.

    Args:
        misses: the token's misses at the layer.
        cpu_pct: the switch's value, 100 x R_cpu / R_link.
    Returns:
        int: the misses the link takes (into slots).
    """
    if misses <= 0:
        return 0
    if cpu_pct <= 0:
        return misses
    return -(-misses * 100 // (100 + cpu_pct))


def hybrid(trace: ExpertTrace, slots: int, cpu_pct: int, refill: int = 0, uncounted: int = 0) -> dict:
    """The native cache's counts with EXPERT_HYBRID=cpu_pct on a trace, every layer with `slots` slots, counted from
    token `uncounted` (0: the first): per token and layer a step of the LRU ("lru"), except that only the first
    `link_share` of its misses (the trace's order of its ids) are inserted; the others the host CPU computes and
    nothing caches. With EXPERT_REFILL=refill (a trace of decoded tokens, one a graph) every miss is the CPU's and the
    first `refill` of a token's misses are inserted (their bytes go up after the CPU has computed them).

    Args:
        trace: the routing ids.
        slots: slots a layer.
        cpu_pct: EXPERT_HYBRID's value.
        refill: EXPERT_REFILL's value (0: off).
        uncounted: tokens run through the slots first without being counted (0: the native counters' view).
    Returns:
        dict: lookups, hits, cpu_misses (computed by the CPU), link_misses (copied into slots before the compute),
        refills (of the CPU's misses, copied into slots after it).
    """
    out = {"lookups": 0, "hits": 0, "cpu_misses": 0, "link_misses": 0, "refills": 0}
    for c in range(len(trace.layers)):
        lru = _Cache(slots)
        for t, ids in enumerate(_steps(trace, c)):
            ids = [int(e) for e in ids]
            hit_ids = [e for e in ids if e in lru]
            misses = [e for e in ids if e not in lru]
            for e in hit_ids:
                lru._hit(e)
            up = misses[:refill] if refill > 0 else misses[:link_share(len(misses), cpu_pct)]
            for e in up:
                lru._miss(e, set(ids))
            if t < uncounted:
                continue
            out["lookups"] += len(ids)
            out["hits"] += len(hit_ids)
            if refill > 0:   # (every miss the CPU's; the refills go up after it)
                out["refills"] += len(up)
                out["cpu_misses"] += len(misses)
            else:
                out["link_misses"] += len(up)
                out["cpu_misses"] += len(misses) - len(up)
    return out


def hit_rates(trace: ExpertTrace, fractions: Iterable[float] = DEFAULT_FRACTIONS,
              policies: Iterable[str] = POLICIES, warmup: Optional[int] = None,
              half_life: float = DEFAULT_HALF_LIFE):
    """simulate() for every policy and fraction, as a pandas DataFrame (one row each, without per_layer).

    Raises:
        ValueError: as simulate().
    """
    import pandas as pd   # (late: the package's facade stays light)
    rows = []
    for policy in policies:
        for fraction in fractions:
            r = simulate(trace, fraction, policy, warmup, half_life)
            r.pop("per_layer")
            rows.append(r)
    return pd.DataFrame(rows)


def locality_summary(trace: ExpertTrace, lags: Sequence[int] = (1, 16)) -> dict:
    """How much a token's experts overlap with those of the token `lag` steps earlier, averaged over tokens and
    layers (a share of k), and the same for tokens far apart (random pairs): the locality a cache lives on.

    Returns:
        dict: "overlap_lag<N>" for each lag, "overlap_random", "k".
    """
    ids = trace.ids
    T, L, k = ids.shape
    out = {"k": int(k)}

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        # a, b: [n, L, k]; the share of a's ids that b has at the same layer
        same = (a[..., :, None] == b[..., None, :]) & (a[..., :, None] >= 0)
        return float(same.any(axis=-1).mean()) if a.size else float("nan")

    for lag in lags:
        out[f"overlap_lag{lag}"] = overlap(ids[lag:], ids[:-lag]) if T > lag else float("nan")
    g = np.random.default_rng(0)
    i, j = g.integers(0, T, 4 * T), g.integers(0, T, 4 * T)
    far = np.abs(i - j) > max(lags)
    out["overlap_random"] = overlap(ids[i[far]], ids[j[far]])
    return out
