"""Micro-batch counting and token-balanced partitioning (Karmarkar–Karp), pure numpy.

Everything here takes a list of sequence lengths and returns index lists; nothing touches tokens,
devices or process groups. The caller all-reduces (MAX) the micro-batch count across DP itself,
through the `reduce_max` callable, so these functions stay testable on one CPU.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "check_budget",
    "first_fit_count",
    "karmarkar_karp",
    "num_micro_batches",
    "partition",
    "split_by_dp",
    "step_micro_batch_counts",
]


def check_budget(lengths: Sequence[int], max_tokens: int) -> None:
    """Raise if one sequence alone is longer than `max_tokens` (no pack could hold it).

    Raises:
        ValueError: naming the first offending index, its length and the budget.
    """
    arr = np.asarray(lengths, dtype=np.int64)
    over = np.flatnonzero(arr > max_tokens)
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"sequence {i} has {int(arr[i])} tokens, more than the budget max_tokens={max_tokens} "
            f"({over.size} sequence(s) over budget); raise max_tokens(_per_gpu) or cp_size, "
            f"or pass truncate=True to cut them to the budget"
        )


def first_fit_count(lengths: Sequence[int], capacity: int) -> int:
    """Number of bins first-fit needs, walking `lengths` in order (no sort), bins of `capacity` tokens.

    This is slime's dynamic micro-batch count. A sequence longer than `capacity` raises (see
    `check_budget`) instead of silently getting an over-budget bin of its own.
    """
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be > 0")
    check_budget(lengths, capacity)
    bins: list[int] = []  # remaining room per open bin
    for n in lengths:
        for b, room in enumerate(bins):
            if n <= room:
                bins[b] = room - n
                break
        else:
            bins.append(capacity - n)
    return len(bins)


def num_micro_batches(
    lengths: Sequence[int],
    *,
    max_tokens: int | None = None,
    cp_size: int = 1,
    micro_batch_size: int | None = None,
    seq_align: int = 1,
    reduce_max: Callable[[int], int] | None = None,
) -> int:
    """Micro-batches for one optimizer step of one DP rank (`lengths` = that rank's samples of the step).

    Exactly one mode:
      - dynamic (`max_tokens` = max_tokens_per_gpu): first-fit bins under `max_tokens * cp_size`
        (a CP group shares the tokens of one micro-batch);
      - static (`micro_batch_size`): `len(lengths) // micro_batch_size`, which equals
        `global_batch_size // (micro_batch_size * dp_size)`.
    `seq_align` (dynamic mode; CP's 2*cp): every sequence costs its length rounded up to a multiple of it and
    the budget is rounded down to one, exactly as `make_step_packs(pad_multiple=seq_align, seq_align=seq_align)`
    packs, so the count is never below the packs this rank needs.
    `reduce_max(n) -> n_max` is called last, e.g. an all-reduce MAX over the DP group, so every DP rank
    runs the same number of micro-batches (FSDP collectives need this).
    """
    if (max_tokens is None) == (micro_batch_size is None):
        raise ValueError("pass exactly one of max_tokens= (dynamic) or micro_batch_size= (static)")
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    if seq_align < 1:
        raise ValueError(f"seq_align={seq_align} must be >= 1")
    if micro_batch_size is not None:
        if micro_batch_size < 1 or len(lengths) % micro_batch_size:
            raise ValueError(
                f"{len(lengths)} samples per rank and step are not divisible by micro_batch_size="
                f"{micro_batch_size}; make global_batch_size a multiple of micro_batch_size * dp_size"
            )
        n = len(lengths) // micro_batch_size
    else:
        budget = max_tokens * cp_size
        n = first_fit_count(_aligned_costs(lengths, budget, seq_align), budget // seq_align * seq_align)
    return int(reduce_max(n)) if reduce_max is not None else n


def _aligned_costs(lengths: Sequence[int], budget: int, seq_align: int) -> list[int]:
    """Each length rounded up to a multiple of `seq_align` (its slot in a pack).

    Raises:
        ValueError: when an aligned slot exceeds `budget` rounded down to a multiple of `seq_align` (names the
            sequence, its length, the alignment and both budgets).
    """
    costs = [-(-int(n) // seq_align) * seq_align for n in lengths]
    capacity = budget // seq_align * seq_align
    over = [i for i, c in enumerate(costs) if c > capacity]
    if seq_align > 1 and over:
        i = over[0]
        raise ValueError(
            f"sequence {i} has {int(lengths[i])} tokens ({costs[i]} with its slot aligned to a multiple of "
            f"{seq_align}, context parallel's 2 x cp_size), more than the budget of {budget} tokens per micro-batch "
            f"(max_tokens_per_gpu x cp_size; {capacity} after alignment); raise max_tokens_per_gpu or cp_size"
        )
    return costs


def step_micro_batch_counts(
    step_lengths: Sequence[Sequence[int]],
    *,
    reduce_max: Callable[[list[int]], list[int]] | None = None,
    **mode,
) -> list[int]:
    """`num_micro_batches` for each optimizer step of a rollout, reduced in ONE call (as slime does).

    `reduce_max` receives the per-step counts and returns their element-wise MAX over DP, e.g.
    `lambda c: all_reduce(torch.tensor(c), op=MAX).tolist()`. `mode` is `max_tokens=`/`cp_size=` or
    `micro_batch_size=`.
    """
    counts = [num_micro_batches(lengths, **mode) for lengths in step_lengths]
    return [int(c) for c in reduce_max(counts)] if reduce_max is not None else counts


def karmarkar_karp(lengths: Sequence[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Karmarkar–Karp largest differencing method for k-way balanced partitioning by sum.

    A state is k sets kept sorted by sum; the two states with the largest spread (max - min, ties to
    the larger max) are merged by pairing the largest set of one with the smallest of the other, until
    one state is left. Set membership is a union-find over the items (a set is named by one of its
    items, -1 when empty), so a merge never copies item lists. Most merges (>90% on long-tailed
    lengths) join a state with a single-item state; that item simply joins the smallest set, an
    O(k) list insertion instead of a sort. Cost: O(N k) for those plus O(k log k) per general merge.

    Args:
        lengths: [N] non-negative sizes.
        k: number of parts, 1 <= k <= N.
        equal_size: every part gets exactly N / k items (requires N % k == 0); the initial states are
            consecutive groups of k length-sorted items, one item per set.
    Returns:
        k lists of indices into `lengths`, each sorted ascending; every index appears once.
    """
    n = len(lengths)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} sequences into k={k} parts; need 1 <= k <= {n}")
    if equal_size and n % k:
        raise ValueError(f"equal-size partitioning needs len(lengths)={n} divisible by k={k}")
    if k == 1:
        return [list(range(n))]
    lens = [int(x) for x in lengths]
    order = sorted(range(n), key=lens.__getitem__)
    parent = list(range(n))  # union-find over items; general merges log edges instead (below)
    edges: tuple[list[int], list[int]] = ([], [])  # (child names, parent names), -1 entries ignored
    tie = itertools.count(n)
    # heap entries: (-spread, -max, tiebreak, sums ascending, set names aligned with sums). Single-item
    # states never enter the heap: they wait in `singles` (longest first, popped from the end) and are
    # expanded only when merged, which keeps the heap small and avoids building N lists of k sums.
    if equal_size:
        groups = [order[g : g + k] for g in range(0, n, k)]
        heap = [(lens[g[0]] - lens[g[-1]], -lens[g[-1]], next(tie), [lens[i] for i in g], g) for g in groups]
        singles: list[int] = []
    else:
        heap, singles = [], order
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    while len(heap) + len(singles) > 1:
        a, b = _kk_take(heap, singles, lens, pop), _kk_take(heap, singles, lens, pop)
        if isinstance(a, int):
            a, b = b, a  # a single item, if any, goes second
        if isinstance(a, int):  # two single items: two one-item sets
            x, y = (a, b) if lens[a] <= lens[b] else (b, a)
            sums, names = [0] * (k - 2) + [lens[x], lens[y]], [-1] * (k - 2) + [x, y]
        elif isinstance(b, int):  # the item joins A's smallest set: an O(k) insertion, no sort
            sums, names = a[3], a[4]
            s0, n0 = sums.pop(0), names.pop(0)
            if n0 == -1:
                n0 = b
            else:
                parent[b] = n0
            pos = bisect.bisect_right(sums, s0 + lens[b])
            sums.insert(pos, s0 + lens[b])
            names.insert(pos, n0)
        else:
            sums, names = _kk_merge(a[3], a[4], b[3], b[4], edges)
        push(heap, (sums[0] - sums[-1], -sums[-1], next(tie), sums, names))
    return _kk_parts(heap[0][4], parent, edges, n)


def _kk_take(heap: list, singles: list[int], lens: list[int], pop) -> tuple | int:
    """The state of largest spread: a heap entry, or a single item (an int) from the stream.
    A single item x has key (-x, -x, index < every heap tiebreak), so it wins ties."""
    if singles:
        x = -lens[singles[-1]]
        if not heap or x < heap[0][0] or (x == heap[0][0] and x <= heap[0][1]):
            return singles.pop()
    return pop(heap)


def _kk_merge(sa: list[int], na: list[int], sb: list[int], nb: list[int], edges) -> tuple[list, list]:
    """General KK merge: set i of A (ascending) with set k-1-i of B, then re-sort by sum."""
    nb_rev = nb[::-1]
    edges[0].extend(nb_rev)  # B's set k-1-i joins A's set i (resolved later, in numpy)
    edges[1].extend(na)
    sums = list(map(operator.add, sa, reversed(sb)))
    names = [x if x != -1 else y for x, y in zip(na, nb_rev)]
    order = sorted(range(len(sums)), key=sums.__getitem__)
    return [sums[i] for i in order], [names[i] for i in order]


def _kk_parts(names: list[int], parent: list[int], edges, n: int) -> list[list[int]]:
    """Resolve the union-find into k index lists (set names are roots), by vectorised pointer jumping."""
    root = np.asarray(parent, dtype=np.int64)
    child, par = np.asarray(edges[0], dtype=np.int64), np.asarray(edges[1], dtype=np.int64)
    ok = (child >= 0) & (par >= 0)
    root[child[ok]] = par[ok]  # every name is a child at most once: it stops being a name then
    while True:
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    part_of_root = np.zeros(n, dtype=np.int64)
    named = [(p, r) for p, r in enumerate(names) if r != -1]
    part_of_root[[r for _, r in named]] = [p for p, _ in named]
    part = part_of_root[root]  # [N] pack of every item
    by_part = np.argsort(part, kind="stable")  # items grouped by pack, ascending within a pack
    bounds = np.searchsorted(part[by_part], np.arange(len(names) + 1))
    return [by_part[bounds[p] : bounds[p + 1]].tolist() for p in range(len(names))]


def split_by_dp(lengths: Sequence[int], dp_size: int, balance: bool = True) -> list[list[int]]:
    """Split a rollout's samples over DP ranks, equal sample counts per rank.

    balance=True: equal-size Karmarkar–Karp on total lengths (balanced tokens per rank, indices sorted).
    balance=False: strided round-robin, rank r gets r, r+dp, r+2dp, ...
    """
    n = len(lengths)
    if dp_size < 1 or n % dp_size:
        raise ValueError(
            f"{n} samples cannot be split evenly over dp_size={dp_size}; make the number of samples "
            f"(rollout_batch_size * n_samples_per_prompt) a multiple of dp_size"
        )
    if not balance or n == 0:
        return [list(range(r, n, dp_size)) for r in range(dp_size)]
    return karmarkar_karp(lengths, dp_size, equal_size=True)


def partition(lengths: Sequence[int], k: int, max_tokens: int | None = None) -> list[list[int]]:
    """Split sequences into k packs balanced by tokens, each pack at most `max_tokens` tokens.

    1. Karmarkar–Karp (`karmarkar_karp`) balances the sums but does not know the budget.
    2. Repair: while a pack is over budget, move one of its sequences to a pack with room for it, or
       swap one with a shorter sequence of another pack that has room for the difference, taking the
       move/swap that leaves the overfull pack lightest. No step creates a new overflow and each
       strictly lowers the fullest pack's overflow, so repair ends.
    3. If repair gets stuck: first-fit-decreasing into k bins, then first-fit in the given order; the
       latter always succeeds when `k >= first_fit_count(lengths, max_tokens)`, so a count computed by
       `num_micro_batches` is never exceeded. Only if k is below that count is a pack added (k+1, ...),
       so the result can have MORE than k packs only when the caller asked for too few.
    Empty packs (possible after step 3) receive a sequence from a pack that holds several; with
    fewer sequences than k, the extra packs stay empty.

    Raises:
        ValueError: k < 1, or a single sequence is longer than `max_tokens` (index, length, budget).
    Returns:
        >= k lists of indices (each sorted ascending, every index exactly once).
    """
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k={k} packs requested; need k >= 1")
    if max_tokens is not None:
        check_budget(lengths, max_tokens)
    if n == 0:
        return [[] for _ in range(k)]
    k_eff = min(k, n)
    parts = karmarkar_karp(lengths, k_eff)
    while max_tokens is not None and not _repair(parts, lengths, max_tokens):
        parts = _first_fit_parts(lengths, k_eff, max_tokens)
        if parts is None:
            k_eff += 1
            parts = karmarkar_karp(lengths, k_eff)
    parts += [[] for _ in range(k - len(parts))]
    _fill_empty(parts, lengths)
    return [sorted(p) for p in parts]


def _repair(parts: list[list[int]], lengths: Sequence[int], budget: int) -> bool:
    """Move/swap sequences out of over-budget packs in place; True when every pack fits.

    Per step, for the fullest pack and each of its sequences i and each other pack q (room r_q), the
    best move is i -> q when len_i <= r_q, and the best swap is with the shortest j in q satisfying
    len_i - r_q <= len_j < len_i (found by bisection on q's sorted lengths).
    """
    keyed = [sorted((lengths[i], i) for i in p) for p in parts]  # per pack, (len, idx) ascending
    loads = [sum(lengths[i] for i in p) for p in parts]
    while True:
        over = max(range(len(parts)), key=loads.__getitem__)
        if loads[over] <= budget:
            parts[:] = [[i for _, i in kp] for kp in keyed]
            return True
        best = None  # (new load of `over`, src item, dst pack, dst item or None)
        for li, i in {li: i for li, i in keyed[over]}.items():
            for q, kq in enumerate(keyed):
                room = budget - loads[q]
                if q == over or room <= 0:
                    continue
                if li <= room:
                    cand = (loads[over] - li, (li, i), q, None)
                else:
                    pos = bisect.bisect_left(kq, (li - room, -1))
                    if pos == len(kq) or kq[pos][0] >= li:
                        continue
                    cand = (loads[over] - li + kq[pos][0], (li, i), q, kq[pos])
                if best is None or cand[0] < best[0]:
                    best = cand
        if best is None:
            return False
        _, a, q, b = best
        _move(keyed, loads, a, over, q)
        if b is not None:
            _move(keyed, loads, b, q, over)


def _move(keyed: list[list[tuple[int, int]]], loads: list[int], item: tuple[int, int], src: int, dst: int) -> None:
    keyed[src].remove(item)
    bisect.insort(keyed[dst], item)
    loads[src] -= item[0]
    loads[dst] += item[0]


def _first_fit_parts(lengths: Sequence[int], k: int, budget: int) -> list[list[int]] | None:
    """First-fit-decreasing, then in-order first-fit, into k bins; None if neither fits."""
    by_size = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for order in (by_size, range(len(lengths))):
        parts: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            b = next((b for b in range(k) if loads[b] + lengths[i] <= budget), None)
            if b is None:
                break
            parts[b].append(i)
            loads[b] += lengths[i]
        else:
            return parts
    return None


def _fill_empty(parts: list[list[int]], lengths: Sequence[int]) -> None:
    """Give each empty pack the shortest sequence of the fullest multi-sequence pack (fits: it was
    already within budget inside a larger pack)."""
    for e in [q for q, p in enumerate(parts) if not p]:
        donors = [q for q, p in enumerate(parts) if len(p) > 1]
        if not donors:
            return
        src = max(donors, key=lambda q: sum(lengths[i] for i in parts[q]))
        item = min(parts[src], key=lambda i: lengths[i])
        parts[src].remove(item)
        parts[e].append(item)
