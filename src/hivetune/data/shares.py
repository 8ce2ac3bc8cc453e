"""A step's examples in shares of near-equal count and token sum: the ranks' shares of a step
(parallel.distributed.Dist.shard) and one process's micro-batches (micro_parts), cut alike."""

from __future__ import annotations

import functools


def micro_parts(ids: list, lengths, size: int, packing: bool) -> list[list]:
    """A step's examples cut into micro-batches of at most `size`: with packing and the examples'
    `lengths` (indexed by example), as many micro-batches as `size` gives, of near-equal counts
    and token sums (balanced_split), so that one process's grad_accum micro-batches are the shares
    that as many ranks would take; else consecutive runs of `size`."""
    n = -(-len(ids) // size)
    if n <= 1 or not packing or lengths is None:
        return [ids[i:i + size] for i in range(0, len(ids), size)]
    return balanced_split(ids, lengths, n)


def balanced_split(ids: list, lengths, n: int) -> list[list]:
    """These examples in `n` shares of near-equal count and token sum (balanced_shares over their
    `lengths`, indexed by example), each share keeping the examples' order."""
    return [[ids[k] for k in sorted(share)] for share in balanced_shares([lengths[i] for i in ids], n)]


def balanced_shares(sizes: list[int], world: int) -> list[list[int]]:
    """Positions of `sizes` split into `world` shares of near-equal count and sum: longest first
    to the lightest share with room, then swaps between the heaviest and the lightest share
    while a swap lowers the heaviest sum. Remembered by its arguments (fresh lists each call):
    the CUDA graphs' plan splits every step of the run at its start and again for each rank's
    own micro-batches (W2: ~9 ms a pass on a small CPU, with the GPU idle at the second); the
    loop's Dist.shard then finds each step's split made."""
    return [list(share) for share in _balanced_shares(tuple(sizes), world)]


@functools.lru_cache(maxsize=8192)
def _balanced_shares(sizes: tuple[int, ...], world: int) -> tuple[tuple[int, ...], ...]:
    room = [len(sizes) // world + (r < len(sizes) % world) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        r = min((r for r in range(world) if room[r]), key=lambda r: (load[r] + sizes[k], r))
        room[r] -= 1
        shares[r].append(k)
        load[r] += sizes[k]
    for _ in range(4 * len(sizes)):
        hi = max(range(world), key=lambda r: (load[r], -r))
        lo = min(range(world), key=lambda r: (load[r], r))
        worst = load[hi]
        best = None
        for i in shares[hi]:
            for j in shares[lo]:
                d = sizes[i] - sizes[j]
                after = max(load[hi] - d, load[lo] + d)
                if d > 0 and after < worst and (best is None or after < best[2]):
                    best = (i, j, after, d)
        if best is None:
            break
        i, j, _, d = best
        shares[hi][shares[hi].index(i)], shares[lo][shares[lo].index(j)] = j, i
        load[hi] -= d
        load[lo] += d
    return tuple(tuple(share) for share in shares)
