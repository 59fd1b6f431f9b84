"""Exactness of a shm run, judged against stock vLLM's own spread.

Stock vLLM 0.33 is not reproducible from run to run on Qwen4Exp (two greedy
outcomes alternate on the H200, parting at the 7th token of the first prompt),
so "identical to stock" cannot mean identical to one stock run. The rule
(issue 33, step 2):

1. a shm outcome **passes exactly** when its token ids and logprobs equal
   those of one stock run, bit for bit;
2. otherwise it **passes within the spread** when, against every stock run, it
   differs by no more than the stock runs differ from each other, measured by

   - the number of sequences whose tokens differ (no more than stock's most),
   - the first position at which a sequence differs (no earlier than stock's
     earliest),
   - the largest logprob difference at the positions before a sequence's first
     difference, where both runs saw the same tokens (no larger than stock's
     largest);

3. otherwise it **fails**. With stock runs that all agree the spread is zero,
   and only rule 1 can pass.

An outcome is what greedy decoding gave for one prompt set: per prompt, the
token ids and, per position, the logprobs vLLM returned (the sampled token's
and the top-k), keyed by token id. Logprobs are compared where both runs have
an entry for the same token id. Outcomes of different prompt sets are never
compared (``Outcome.prompts_digest``).

Pure Python (no vLLM, no torch): the summary runs it wherever the cell JSONs
are.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Outcome:
    """Greedy output of one run over one prompt set."""

    tokens: tuple[tuple[int, ...], ...]
    # per prompt, per position: {token id: logprob}
    logprobs: tuple[tuple[dict[int, float], ...], ...]
    prompts_digest: str = ""

    @classmethod
    def from_json(cls, data: dict) -> Outcome:
        return cls(
            tokens=tuple(tuple(int(t) for t in seq) for seq in data["tokens"]),
            logprobs=tuple(
                tuple({int(k): float(v) for k, v in pos.items()} for pos in seq)
                for seq in data["logprobs"]
            ),
            prompts_digest=data.get("prompts_digest", ""),
        )

    def to_json(self) -> dict:
        return {
            "prompts_digest": self.prompts_digest,
            "tokens": [list(seq) for seq in self.tokens],
            "logprobs": [
                [{str(k): v for k, v in pos.items()} for pos in seq] for seq in self.logprobs
            ],
        }

    def key(self) -> tuple:
        """Equal keys: equal token ids and logprobs, bit for bit."""
        return (
            self.tokens,
            tuple(tuple(tuple(sorted(pos.items())) for pos in seq) for seq in self.logprobs),
        )


@dataclass(frozen=True)
class Difference:
    """How two outcomes of the same prompts differ."""

    sequences: int  # sequences whose token ids differ
    first_position: float  # earliest position where tokens differ (inf: none)
    max_logprob: float  # largest |Δ logprob| before each sequence's first difference

    def within(self, bound: Difference) -> bool:
        return (
            self.sequences <= bound.sequences
            and self.first_position >= bound.first_position
            and self.max_logprob <= bound.max_logprob
        )

    def to_json(self) -> dict:
        return {
            "sequences": self.sequences,
            "first_position": None if math.isinf(self.first_position) else int(self.first_position),
            "max_logprob": self.max_logprob,
        }


NO_DIFFERENCE = Difference(0, math.inf, 0.0)


class IncomparableOutcomes(ValueError):
    """Two outcomes that are not of the same prompt set."""


def difference(a: Outcome, b: Outcome) -> Difference:
    if a.prompts_digest != b.prompts_digest or len(a.tokens) != len(b.tokens):
        raise IncomparableOutcomes(
            f"outcomes of different prompt sets ({a.prompts_digest or '?'}, "
            f"{len(a.tokens)} prompts vs {b.prompts_digest or '?'}, {len(b.tokens)}): "
            "compare runs of the same prompts only"
        )
    sequences, first, largest = 0, math.inf, 0.0
    for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logprobs, b.logprobs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        if n is None and len(ta) != len(tb):
            n = min(len(ta), len(tb))
        if n is not None:
            sequences += 1
            first = min(first, n)
        agree = min(len(ta), len(tb)) if n is None else n
        for pa, pb in itertools.islice(zip(la, lb, strict=False), agree):
            for token in pa.keys() & pb.keys():
                largest = max(largest, abs(pa[token] - pb[token]))
    return Difference(sequences, first, largest)


def envelope(diffs: list[Difference]) -> Difference:
    """The largest difference in each measure (earliest first position)."""
    if not diffs:
        return NO_DIFFERENCE
    return Difference(
        max(d.sequences for d in diffs),
        min(d.first_position for d in diffs),
        max(d.max_logprob for d in diffs),
    )


@dataclass
class Verdict:
    passed: bool
    how: str  # "identical" | "within spread" | "outside spread"
    detail: str
    identical_to: list[int] = field(default_factory=list)  # indices of equal stock runs
    stock_spread: Difference = NO_DIFFERENCE
    against_stock: list[Difference] = field(default_factory=list)
    stock_outcomes: int = 0  # distinct outcomes among the stock runs

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "how": self.how,
            "detail": self.detail,
            "identical_to": self.identical_to,
            "stock_runs": len(self.against_stock),
            "stock_outcomes": self.stock_outcomes,
            "stock_spread": self.stock_spread.to_json(),
            "against_stock": [d.to_json() for d in self.against_stock],
        }


def distinct_outcomes(outcomes: list[Outcome]) -> int:
    return len({o.key() for o in outcomes})


def judge(stock: list[Outcome], candidate: Outcome) -> Verdict:
    """Pass or fail ``candidate`` against two or more stock runs (rules above)."""
    if len(stock) < 2:
        raise ValueError(
            f"{len(stock)} stock run(s): the spread needs at least two; run the stock "
            "cell of this mode twice (or with more exact repetitions)"
        )
    against = [difference(candidate, s) for s in stock]
    spread = envelope([difference(a, b) for a, b in itertools.combinations(stock, 2)])
    distinct = distinct_outcomes(stock)
    equal = [i for i, s in enumerate(stock) if s.key() == candidate.key()]
    if equal:
        return Verdict(
            True,
            "identical",
            f"equal to stock run(s) {equal} of {len(stock)} ({distinct} distinct stock outcomes)",
            equal,
            spread,
            against,
            distinct,
        )
    worst = envelope(against)
    if all(d.within(spread) for d in against):
        return Verdict(
            True,
            "within spread",
            f"differs from each stock run by no more than stock from itself "
            f"(worst {_text(worst)}; stock {_text(spread)})",
            [],
            spread,
            against,
            distinct,
        )
    return Verdict(
        False,
        "outside spread",
        f"differs from stock by more than stock from itself (worst {_text(worst)}; "
        f"stock {_text(spread)})",
        [],
        spread,
        against,
        distinct,
    )


def _text(d: Difference) -> str:
    first = "none" if math.isinf(d.first_position) else str(int(d.first_position))
    return f"{d.sequences} sequences, first at {first}, logprob Δ {d.max_logprob:.3g}"
