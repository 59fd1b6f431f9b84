#!/usr/bin/env python3
"""Row cache vs page cache at equal bytes, on the real-text trace.

Replays the trace of ``bench/sim/text_trace.py`` in serving order (decode steps of
32 sequences × 16 ids, the sequences being 32 equal lanes of the token stream)
through

- a **row cache** of ``budget / (row_bytes + overhead)`` rows, with SIEVE,
  CLOCK (second chance, new rows inserted unmarked), S3-FIFO (10 % small FIFO,
  main FIFO, ghost FIFO as long as the main one, 2-bit frequencies, a row seen
  again while in the small FIFO moves to the main one) and LRU;
- an **LRU page cache** of ``budget / 4096`` pages over the rows' file offsets
  (row r at byte ``r × row_bytes``; a row that straddles two pages needs both),
  which is what the kernel's page cache would be asked for by mmap mode or
  buffered reads with readahead off (the kernel's active/inactive lists are an
  LRU approximation).

A row access is a hit when the cache holds the row (for the page cache: all
the pages that hold it). Budgets are fractions of the whole table (≈ 320 M
rows × 160 B ≈ 47.7 GiB at Qwen3.8-Flash-Next geometry). Hit rates are given
over the whole replay (cold start) and over its second half (warm); an
infinite cache bounds both (every first access is a miss).

    python -m bench.sim.cache_sim --trace bench/traces/qwen-text.npz --check --json sim.json

The simulators are compiled with numba (the ``bench`` extra); a full run of
8 budgets takes about a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from numba import njit

from bench.harness.checkout import TRACE
from bench.harness.scaffold import add_json, parser, save_json
from bench.sim.text_trace import load_trace

PAGE = 4096
POLICIES = ("SIEVE", "CLOCK", "S3-FIFO", "LRU")
DEFAULT_BUDGETS = "0.05,0.1,0.25,0.5,1,5,10,25"


# ------------------------------------------------------------------ policies
# Every simulator takes dense keys (0 .. nkeys-1, one per access) and a
# capacity in entries, and returns one hit flag per access.


@njit(cache=True)
def sim_lru(keys, nkeys, capacity):
    hits = np.zeros(keys.size, np.uint8)
    prev = np.full(nkeys, -1, np.int64)
    nxt = np.full(nkeys, -1, np.int64)
    cached = np.zeros(nkeys, np.uint8)
    head = -1  # most recent
    tail = -1  # least recent
    size = 0
    for i in range(keys.size):
        k = keys[i]
        if cached[k]:
            hits[i] = 1
            if head == k:
                continue
            # unlink
            p, n = prev[k], nxt[k]
            nxt[p] = n
            if n != -1:
                prev[n] = p
            else:
                tail = p
        else:
            if size == capacity:
                v = tail
                tail = prev[v]
                if tail != -1:
                    nxt[tail] = -1
                else:
                    head = -1
                cached[v] = 0
                size -= 1
            cached[k] = 1
            size += 1
        # push front
        prev[k] = -1
        nxt[k] = head
        if head != -1:
            prev[head] = k
        head = k
        if tail == -1:
            tail = k
    return hits


@njit(cache=True)
def sim_clock(keys, nkeys, capacity):
    hits = np.zeros(keys.size, np.uint8)
    slot_key = np.full(capacity, -1, np.int64)
    ref = np.zeros(capacity, np.uint8)
    where = np.full(nkeys, -1, np.int64)
    hand = 0
    used = 0
    for i in range(keys.size):
        k = keys[i]
        s = where[k]
        if s != -1:
            hits[i] = 1
            ref[s] = 1
            continue
        if used < capacity:
            s = used
            used += 1
        else:
            while ref[hand]:
                ref[hand] = 0
                hand += 1
                if hand == capacity:
                    hand = 0
            s = hand
            where[slot_key[s]] = -1
            hand += 1
            if hand == capacity:
                hand = 0
        slot_key[s] = k
        ref[s] = 0
        where[k] = s
    return hits


@njit(cache=True)
def sim_sieve(keys, nkeys, capacity):
    """SIEVE (Zhang et al., NSDI '24): one FIFO list; hits only set a bit; the
    hand walks from the oldest towards the newest, clearing bits, and evicts
    the first unmarked entry; new entries go to the head."""
    hits = np.zeros(keys.size, np.uint8)
    prev = np.full(nkeys, -1, np.int64)  # towards the tail (older)
    nxt = np.full(nkeys, -1, np.int64)  # towards the head (newer)
    cached = np.zeros(nkeys, np.uint8)
    visited = np.zeros(nkeys, np.uint8)
    head = -1  # newest
    tail = -1  # oldest
    hand = -1
    size = 0
    for i in range(keys.size):
        k = keys[i]
        if cached[k]:
            hits[i] = 1
            visited[k] = 1
            continue
        if size == capacity:
            h = hand if hand != -1 else tail
            while visited[h]:
                visited[h] = 0
                h = nxt[h]
                if h == -1:
                    h = tail
            hand = nxt[h]
            # unlink h
            p, n = prev[h], nxt[h]
            if p != -1:
                nxt[p] = n
            else:
                tail = n
            if n != -1:
                prev[n] = p
            else:
                head = p
            cached[h] = 0
            size -= 1
        cached[k] = 1
        visited[k] = 0
        prev[k] = head
        nxt[k] = -1
        if head != -1:
            nxt[head] = k
        head = k
        if tail == -1:
            tail = k
        size += 1
    return hits


@njit(cache=True)
def _evict_main(main, m_head, m_len, freq, where):
    """S3-FIFO's main FIFO: reinsert entries with a frequency (one less), evict
    the first without; returns the new head and length."""
    ring = main.size
    while True:
        u = main[m_head]
        m_head = (m_head + 1) % ring
        m_len -= 1
        if freq[u] > 0:
            freq[u] -= 1
            main[(m_head + m_len) % ring] = u
            m_len += 1
        else:
            where[u] = 0
            return m_head, m_len


@njit(cache=True)
def sim_s3fifo(keys, nkeys, capacity):
    """S3-FIFO (Yang et al., SOSP '23): small FIFO (10 %), main FIFO, ghost
    FIFO of keys (as many as the main FIFO holds); frequencies capped at 3."""
    hits = np.zeros(keys.size, np.uint8)
    small_cap = max(1, capacity // 10)
    main_cap = max(1, capacity - small_cap)
    where = np.zeros(nkeys, np.uint8)  # 0 absent, 1 small, 2 main
    freq = np.zeros(nkeys, np.uint8)
    # FIFOs as ring buffers of keys; the small one holds everything until the
    # cache first fills
    small = np.empty(capacity + 1, np.int64)
    s_head = 0
    s_len = 0
    main = np.empty(main_cap + 1, np.int64)
    m_head = 0
    m_len = 0
    ghost = np.empty(main_cap, np.int64)
    ghost_at = np.full(nkeys, -1, np.int64)  # insertion count when ghosted
    ghost_count = 0
    for i in range(keys.size):
        k = keys[i]
        if where[k]:
            hits[i] = 1
            if freq[k] < 3:
                freq[k] += 1
            continue
        # miss: make room first
        while s_len + m_len >= capacity:
            if s_len >= small_cap or m_len == 0:
                t = small[s_head]
                s_head = (s_head + 1) % (capacity + 1)
                s_len -= 1
                if freq[t] >= 1:
                    while m_len >= main_cap:
                        m_head, m_len = _evict_main(main, m_head, m_len, freq, where)
                    freq[t] = 0
                    where[t] = 2
                    main[(m_head + m_len) % (main_cap + 1)] = t
                    m_len += 1
                else:
                    where[t] = 0
                    ghost[ghost_count % main_cap] = t
                    ghost_at[t] = ghost_count
                    ghost_count += 1
            else:
                m_head, m_len = _evict_main(main, m_head, m_len, freq, where)
        freq[k] = 0
        g = ghost_at[k]
        if g != -1 and g >= ghost_count - main_cap:
            ghost_at[k] = -1
            where[k] = 2
            if m_len >= main_cap:  # the small FIFO holds the rest: evict from main
                m_head, m_len = _evict_main(main, m_head, m_len, freq, where)
            main[(m_head + m_len) % (main_cap + 1)] = k
            m_len += 1
        else:
            where[k] = 1
            small[(s_head + s_len) % (capacity + 1)] = k
            s_len += 1
    return hits


SIMULATORS = {"SIEVE": sim_sieve, "CLOCK": sim_clock, "S3-FIFO": sim_s3fifo, "LRU": sim_lru}


# ------------------------------------------------- plain Python references
def ref_lru(keys, capacity):
    from collections import OrderedDict

    cache, hits = OrderedDict(), []
    for k in keys:
        if k in cache:
            cache.move_to_end(k)
            hits.append(1)
        else:
            hits.append(0)
            if len(cache) == capacity:
                cache.popitem(last=False)
            cache[k] = True
    return hits


def ref_clock(keys, capacity):
    slots, ref, where, hand, used, hits = [None] * capacity, [0] * capacity, {}, 0, 0, []
    for k in keys:
        if k in where:
            ref[where[k]] = 1
            hits.append(1)
            continue
        hits.append(0)
        if used < capacity:
            s, used = used, used + 1
        else:
            while ref[hand]:
                ref[hand], hand = 0, (hand + 1) % capacity
            s = hand
            del where[slots[s]]
            hand = (hand + 1) % capacity
        slots[s], ref[s], where[k] = k, 0, s
    return hits


def ref_sieve(keys, capacity):
    queue, visited, hand, hits = [], {}, None, []  # queue: oldest first
    for k in keys:
        if k in visited:
            visited[k] = 1
            hits.append(1)
            continue
        hits.append(0)
        if len(queue) == capacity:
            i = 0 if hand is None else hand
            while visited[queue[i]]:
                visited[queue[i]] = 0
                i = (i + 1) % len(queue)
            del visited[queue[i]]
            queue.pop(i)
            hand = i if i < len(queue) else None
        queue.append(k)
        visited[k] = 0
    return hits


def ref_s3fifo(keys, capacity):
    from collections import deque

    small_cap = max(1, capacity // 10)
    main_cap = max(1, capacity - small_cap)
    small, main, ghost_at, freq, where, hits, ghosts = deque(), deque(), {}, {}, {}, [], 0

    def evict_main():
        while True:
            u = main.popleft()
            if freq[u] > 0:
                freq[u] -= 1
                main.append(u)
            else:
                del where[u]
                return

    for k in keys:
        if k in where:
            hits.append(1)
            freq[k] = min(freq[k] + 1, 3)
            continue
        hits.append(0)
        while len(small) + len(main) >= capacity:
            if len(small) >= small_cap or not main:
                t = small.popleft()
                if freq[t] >= 1:
                    while len(main) >= main_cap:
                        evict_main()
                    freq[t], where[t] = 0, 2
                    main.append(t)
                else:
                    del where[t]
                    ghost_at[t], ghosts = ghosts, ghosts + 1
            else:
                evict_main()
        freq[k] = 0
        if k in ghost_at and ghost_at[k] >= ghosts - main_cap:
            del ghost_at[k]
            where[k] = 2
            if len(main) >= main_cap:
                evict_main()
            main.append(k)
        else:
            where[k] = 1
            small.append(k)
    return hits


REFERENCES = {"SIEVE": ref_sieve, "CLOCK": ref_clock, "S3-FIFO": ref_s3fifo, "LRU": ref_lru}


def self_check() -> None:
    """Every simulator gives the same hit sequence as its plain reference, on a
    Zipf stream, at several capacities."""
    keys = (np.random.default_rng(1).zipf(1.2, 100_000) % 5000).astype(np.int64)
    for capacity in (1, 7, 100, 1000):
        for name, sim in SIMULATORS.items():
            got = sim(keys, 5000, capacity)
            want = np.asarray(REFERENCES[name](keys.tolist(), capacity), dtype=np.uint8)
            if not np.array_equal(got, want):
                raise SystemExit(
                    f"{name} at capacity {capacity} differs from its reference "
                    f"(first at access {int(np.flatnonzero(got != want)[0])})"
                )
    print("check: the four simulators equal their references", file=sys.stderr)


# ----------------------------------------------------------------- workloads
def dense(keys: np.ndarray) -> tuple[np.ndarray, int]:
    uniq, inverse = np.unique(keys, return_inverse=True)
    return inverse.astype(np.int64).reshape(-1), int(uniq.size)


def page_accesses(rows: np.ndarray, row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The page stream a row stream makes (two pages for a straddling row), and
    for each page access the index of its row access."""
    first = rows * row_bytes // PAGE
    last = (rows * row_bytes + row_bytes - 1) // PAGE
    two = last != first
    owner = np.repeat(np.arange(rows.size), 1 + two)
    pages = np.empty(owner.size, np.int64)
    starts = np.concatenate([[0], np.cumsum(1 + two)[:-1]])
    pages[starts] = first
    pages[starts[two] + 1] = last[two]
    return pages, owner


def rates(hits: np.ndarray) -> dict:
    half = hits.size // 2
    return {"hit": float(hits.mean()), "hit_warm": float(hits[half:].mean())}


def simulate(args) -> dict:
    trace = load_trace(args.trace)
    row_bytes = trace.meta["geometry"]["row_cols"] * args.itemsize
    table_rows = trace.rows
    stream = trace.decode_steps(args.sequences).reshape(-1)
    if args.accesses:
        stream = stream[: args.accesses]
    keys, nrows = dense(stream)
    pages, owner = page_accesses(stream, row_bytes)
    page_keys, npages = dense(pages)
    bound = np.ones(keys.size, np.uint8)
    _, first_idx = np.unique(keys, return_index=True)
    bound[first_idx] = 0
    result = {
        "trace": {
            "path": os.path.basename(args.trace),
            "sha256": trace.sha256,
            "tokens": len(trace.ids),
            "accesses": int(keys.size),
            "distinct_rows": nrows,
            "distinct_pages": npages,
            "straddling_accesses": int(pages.size - keys.size),
        },
        "table": {
            "rows": table_rows,
            "row_bytes": row_bytes,
            "gib": round(table_rows * row_bytes / 2**30, 2),
        },
        "order": f"decode steps of {args.sequences} sequences × 16 ids",
        "row_overhead_bytes": args.row_overhead,
        "infinite": rates(bound),
        "budgets": [],
    }
    for pct in args.budgets:
        budget = int(table_rows * row_bytes * pct / 100)
        entry = {
            "pct": pct,
            "bytes": budget,
            "row_capacity": budget // (row_bytes + args.row_overhead),
            "page_capacity": budget // PAGE,
        }
        for policy in args.policies:
            t0 = time.monotonic()
            hits = SIMULATORS[policy](keys, nrows, max(1, entry["row_capacity"]))
            entry[policy] = {**rates(hits), "seconds": round(time.monotonic() - t0, 2)}
        t0 = time.monotonic()
        page_hits = sim_lru(page_keys, npages, max(1, entry["page_capacity"]))
        row_hits = np.ones(keys.size, np.uint8)
        np.minimum.at(row_hits, owner, page_hits)
        entry["page-LRU"] = {
            **rates(row_hits),
            "page_reads": int(page_hits.size - page_hits.sum()),
            "seconds": round(time.monotonic() - t0, 2),
        }
        result["budgets"].append(entry)
        print(
            f"  {pct:g} %: "
            + ", ".join(f"{k} {entry[k]['hit']:.3f}" for k in (*args.policies, "page-LRU")),
            file=sys.stderr,
            flush=True,
        )
    return result


def report(result: dict, policies, stream=sys.stdout) -> None:
    w = lambda s="": print(s, file=stream)  # noqa: E731
    t, tb = result["trace"], result["table"]
    w(
        f"trace {t['path']} (sha256 {t['sha256'][:12]}…): {t['tokens']:,} tokens, "
        f"{t['accesses']:,} row accesses ({result['order']}), {t['distinct_rows']:,} distinct "
        f"rows, {t['distinct_pages']:,} distinct pages"
    )
    w(
        f"table {tb['rows']:,} rows × {tb['row_bytes']} B = {tb['gib']} GiB; row overhead "
        f"{result['row_overhead_bytes']} B; infinite cache: {result['infinite']['hit']:.1%} "
        f"(second half {result['infinite']['hit_warm']:.1%})"
    )
    w()
    cols = [*policies, "page-LRU"]
    w("hit rate, whole replay (second half)")
    w("| budget | bytes | rows | pages | " + " | ".join(cols) + " |")
    w("|---" * (4 + len(cols)) + "|")
    for e in result["budgets"]:
        w(
            f"| {e['pct']:g} % | {e['bytes'] / 2**30:.2f} GiB | {e['row_capacity']:,} | "
            f"{e['page_capacity']:,} | "
            + " | ".join(f"{e[c]['hit']:.1%} ({e[c]['hit_warm']:.1%})" for c in cols)
            + " |"
        )


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__, work_dir=False)
    ap.add_argument("--trace", default=TRACE, help="the trace (bench.sim.text_trace's)")
    ap.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help=f"budgets in %% of the table (default {DEFAULT_BUDGETS})",
    )
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sequences", type=int, default=32, help="decode lanes (default 32)")
    ap.add_argument("--itemsize", type=int, default=1, help="bytes per column (FP8: 1)")
    ap.add_argument(
        "--row-overhead",
        type=int,
        default=0,
        help="bytes of index per cached row, charged to the row cache",
    )
    ap.add_argument("--accesses", type=int, default=0, help="replay only the first N")
    ap.add_argument(
        "--check",
        action="store_true",
        help="first compare every simulator with a plain Python reference",
    )
    add_json(ap)
    args = ap.parse_args(argv)
    args.budgets = [float(x) for x in args.budgets.split(",") if x]
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check:
        self_check()
    result = simulate(args)
    result["command"] = "python -m bench.sim.cache_sim " + " ".join(sys.argv[1:])
    report(result, args.policies)
    save_json(result, args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
