"""tau by context length: each decoded turn's prompt length (its prompt tokens, the earlier turns
and their answers included) puts its verification cycles in a bucket, and each bucket gets
acceptance_stats (eaglet/engines/hf/decode.py) over its cycles pooled, as an evaluation's
aggregate gets it over all of them. A draft trained on short samples may lose acceptance on long
contexts; this is where an evaluation shows it. Change the buckets here (CONTEXT_EDGES and their
names, CONTEXT_BUCKETS): the eval result, its plot and summaries, and bench/ab.py read them."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

from ..engines.hf.decode import acceptance_stats

# a bucket holds prompt lengths (tokens) from one edge up to, not including, the next
CONTEXT_EDGES = (512, 2048, 8192)
CONTEXT_BUCKETS = ("<512", "512-2k", "2k-8k", ">=8k")
assert len(CONTEXT_BUCKETS) == len(CONTEXT_EDGES) + 1


def context_bucket(prompt_tokens: int) -> str:
    """The bucket of a turn whose prompt holds `prompt_tokens` tokens."""
    return CONTEXT_BUCKETS[bisect_right(CONTEXT_EDGES, prompt_tokens)]


def by_context_length(turns: Iterable[tuple[int, Sequence[int]]], num_positions: int) -> dict[str, dict[str, Any]]:
    """Per bucket present, in bucket order, over `turns` (each: its prompt length, its accepted
    count per verification cycle): the turns, their cycles, and acceptance_stats over the cycles
    pooled (tau, acceptance and reach per draft position), so that a bucket's tau is the
    aggregate's, over that bucket's cycles. Buckets without a turn are left out."""
    counts: dict[str, int] = {}
    cycles: dict[str, list[int]] = {}
    for prompt_tokens, accepted in turns:
        bucket = context_bucket(prompt_tokens)
        counts[bucket] = counts.get(bucket, 0) + 1
        cycles.setdefault(bucket, []).extend(int(a) for a in accepted)
    out = {}
    for bucket in CONTEXT_BUCKETS:
        if bucket in counts:
            stats = acceptance_stats(cycles[bucket], num_positions)
            out[bucket] = {"turns": counts[bucket], "cycles": stats["verify_forwards"], "tau": stats["tau"],
                           "acceptance_rate": stats["acceptance_rate"], "position_reached": stats["position_reached"]}
    return out


def of_records(records: Iterable[dict[str, Any]], num_positions: int) -> dict[str, dict[str, Any]]:
    """`by_context_length` of an evaluation's records (their prompt_tokens and accepted_per_forward)."""
    return by_context_length(((r["prompt_tokens"], r["accepted_per_forward"]) for r in records), num_positions)


def context_length_text(buckets: dict[str, dict[str, Any]]) -> str:
    """The buckets in one phrase: `<512 2.10 (30 turns), 512-2k 1.80 (5 turns)`."""
    return ", ".join(f"{b} {'-' if s['tau'] is None else format(s['tau'], '.2f')} "
                     f"({s['turns']} turn{'s' if s['turns'] != 1 else ''})" for b, s in buckets.items())
