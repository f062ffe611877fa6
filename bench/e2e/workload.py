"""Workloads of the end-to-end benchmarks: multi-turn conversations and long prompts with a
shared cached prefix. Token ids are functions of the seed: every configuration replays the same
trace."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Conversation:
    """One client: a first prompt, then one question per later round. Round ``r``'s prompt is
    the whole history (every earlier prompt and its one output token) plus the new question
    (SGLang ``bench_multiturn``, output length 1)."""

    first_prompt: list[int]
    questions: list[list[int]]
    output_tokens: list[int]
    history: list[int] = field(default_factory=list)
    round: int = 0

    @property
    def done(self) -> bool:
        return self.round > len(self.questions)

    def next_prompt(self) -> list[int]:
        return self.history + (self.questions[self.round - 1] if self.round else self.first_prompt)

    def complete_round(self, prompt: list[int]) -> None:
        self.history = prompt + [self.output_tokens[self.round]]
        self.round += 1

    def tokens(self) -> int:
        """Tokens of KV the conversation leaves: every prompt and output token."""
        return len(self.first_prompt) + sum(map(len, self.questions)) + len(self.output_tokens)


def make_conversations(
    clients: int, rounds: int, first: int, question: int, vocab: int, seed: int
) -> list[Conversation]:
    """``clients`` conversations of ``rounds`` rounds: a ``first``-token prompt, then
    ``question``-token questions; ids in ``[1, vocab)``."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    return [
        Conversation(tokens(first), [tokens(question) for _ in range(rounds - 1)], tokens(rounds))
        for _ in range(clients)
    ]


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """``num`` arrival times (s) of a Poisson process of ``rate`` per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def cached_prompts(
    num: int, length: int, cached_fraction: float, prefixes: int, vocab: int, seed: int
) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens whose first ``cached_fraction`` is one of
    ``prefixes`` shared prefixes (long inputs, mostly cached: the optimistic workload)."""
    rng = random.Random(seed)
    n = int(length * cached_fraction)
    shared = [[rng.randrange(1, vocab) for _ in range(n)] for _ in range(prefixes)]
    return [
        shared[i % prefixes] + [rng.randrange(1, vocab) for _ in range(length - n)]
        for i in range(num)
    ]
