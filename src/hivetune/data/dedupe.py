"""Duplicate finding in bounded memory, for files too large to hold.

Exact duplicates: every record's 64-bit key (``scan.exact_key``) with the line it was first seen
on, 16 bytes a record in sorted numpy arrays (two million records: 32 MB), plus a dict of the
newest keys that is merged into the arrays every 65,536 records.

Near duplicates use synth's measure on prompts (lower-cased alphanumeric words, word 3-gram
shingles, Jaccard similarity >= 0.8) but not synth's all-pairs inverted index, whose posting
lists grow with the file and whose lookups become slow on templated data. Instead:

- MinHash: each shingle is hashed (CRC32), then 64 multiply-shift hashes of it are taken and the
  minimum of each over the prompt's shingles forms its signature; two prompts agree on one
  signature value with probability equal to their Jaccard similarity.
- LSH: the signature is cut into 16 bands of 4 values. Prompts that agree on a whole band land
  in the same bucket; with similarity s a pair shares at least one bucket with probability
  1 - (1 - s^4)^16: 0.9998 at s = 0.8, 1.0 at s >= 0.9, 0.64 at s = 0.5.
- Buckets are a fixed numpy table, 16 bands x 32,768 slots x 4 record ids (8 MiB); a slot keeps
  its 4 newest ids, so a crowded bucket forgets its older members.
- Candidates from the buckets are confirmed with the exact Jaccard of their shingle sets, so a
  reported pair is always >= 0.8 similar.
- The bound: only the last 65,536 prompts, and at most 16 MiB of their shingles, can be matched.
  A near duplicate further back than that window, or pushed out of a crowded bucket, is missed.
  Worst case about 8 + 16 + 3 MiB whatever the file size.
"""

from __future__ import annotations

import zlib
from array import array

import numpy as np

from hivetune.data.synth import NEAR_DUPLICATE_THRESHOLD, _shingles

NUM_BANDS = 16
ROWS_PER_BAND = 4
SLOTS_PER_BAND = 1 << 15
IDS_PER_SLOT = 4
WINDOW = 1 << 16
SHINGLE_BYTES_BUDGET = 16 << 20
_MERGE_EVERY = 1 << 16


class FirstSeen:
    """Map 64-bit keys to the first line they were seen on, in ~16 bytes a key."""

    def __init__(self):
        self._keys = np.empty(0, dtype=np.uint64)  # sorted
        self._lines = np.empty(0, dtype=np.int64)  # line of each key in _keys
        self._recent: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._keys) + len(self._recent)

    def first_line(self, key: int) -> int | None:
        line = self._recent.get(key)
        if line is not None or not len(self._keys):
            return line
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        if i < len(self._keys) and int(self._keys[i]) == key:
            return int(self._lines[i])
        return None

    def add(self, key: int, line: int) -> int | None:
        """Remember `key` at `line` unless already known; return the earlier line if it was."""
        earlier = self.first_line(key)
        if earlier is not None:
            return earlier
        self._recent[key] = line
        if len(self._recent) >= _MERGE_EVERY:
            self._merge()
        return None

    def _merge(self) -> None:
        keys = np.concatenate([self._keys, np.fromiter(self._recent.keys(), np.uint64, len(self._recent))])
        lines = np.concatenate([self._lines, np.fromiter(self._recent.values(), np.int64, len(self._recent))])
        order = np.argsort(keys, kind="stable")
        self._keys, self._lines = keys[order], lines[order]
        self._recent = {}


class NearDuplicateIndex:
    """Find an earlier prompt whose shingle Jaccard similarity with this one is >= threshold."""

    def __init__(self, threshold: float = NEAR_DUPLICATE_THRESHOLD, window: int = WINDOW,
                 shingle_bytes_budget: int = SHINGLE_BYTES_BUDGET, seed: int = 0):
        self.threshold = threshold
        self.window = window
        self.budget = shingle_bytes_budget
        rng = np.random.default_rng(seed)
        n_hashes = NUM_BANDS * ROWS_PER_BAND
        # Multiply-shift hashing: h(x) = ((a*x + b) mod 2^64) >> 32 with odd a; uint64 wraps.
        self._a = rng.integers(1, 2**63, n_hashes, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 2**63, n_hashes, dtype=np.uint64)
        self._band_mix = rng.integers(1, 2**63, ROWS_PER_BAND, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._bands = np.arange(NUM_BANDS)
        self._table = np.full((NUM_BANDS, SLOTS_PER_BAND, IDS_PER_SLOT), -1, dtype=np.int32)
        self._shingles: list[bytes | None] = [None] * window  # ring, indexed by id % window
        self._lines = array("q", [0]) * window
        self._next_id = 0
        self._oldest = 0  # ids below this have been evicted
        self._bytes = 0

    def check_and_add(self, text: str, line: int) -> tuple[int, float] | None:
        """(line, similarity) of an earlier near duplicate of `text`, or None; then remember it.

        Text with no alphanumeric word is neither checked nor remembered."""
        words = _shingles(text)
        if words == frozenset({""}):
            return None
        hashes = np.unique(np.fromiter((zlib.crc32(s.encode()) for s in words), np.uint64, len(words)))
        signature = ((hashes[:, None] * self._a + self._b) >> np.uint64(32)).min(axis=0)
        keys = (signature.reshape(NUM_BANDS, ROWS_PER_BAND) * self._band_mix).sum(axis=1)
        slots = (keys >> np.uint64(64 - 15)).astype(np.intp)
        ids = self._table[self._bands, slots]  # [bands, ids_per_slot]
        match = self._best_match(hashes, ids)
        self._add(hashes.astype(np.uint32).tobytes(), line, slots, ids)
        return match

    def _best_match(self, hashes: np.ndarray, ids: np.ndarray) -> tuple[int, float] | None:
        live = np.unique(ids[ids >= self._oldest])
        if not len(live):
            return None
        mine = set(hashes.tolist())
        best = None
        for candidate in live[::-1].tolist():  # newest first; report the closest, ties: newest
            theirs = memoryview(self._shingles[candidate % self.window]).cast("I")
            shared = len(mine.intersection(theirs))
            similarity = shared / (len(mine) + len(theirs) - shared)
            if similarity >= self.threshold and (best is None or similarity > best[1]):
                best = (self._lines[candidate % self.window], similarity)
        return best

    def _add(self, shingles: bytes, line: int, slots: np.ndarray, ids: np.ndarray) -> None:
        new_id = self._next_id
        if new_id >= 2**31 - 1:
            return  # int32 ids exhausted (two billion prompts): stop remembering
        self._next_id += 1
        while self._next_id - self._oldest > self.window or (
                self._bytes + len(shingles) > self.budget and self._oldest < new_id):
            old = self._oldest % self.window
            self._bytes -= len(self._shingles[old])
            self._shingles[old] = None
            self._oldest += 1
        self._shingles[new_id % self.window] = shingles
        self._lines[new_id % self.window] = line
        self._bytes += len(shingles)
        # Newest id first in each slot; the oldest of the slot's 4 falls off.
        self._table[self._bands, slots, 1:] = ids[:, :-1]
        self._table[self._bands, slots, 0] = new_id
