"""Workloads for the end-to-end benchmarks: multi-turn conversations and long cached prompts.

Token ids are deterministic functions of the seed, so every configuration of a benchmark replays
the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Conversation:
    """One client: a first prompt, then one new question per later round.

    Round ``r``'s prompt is the whole history: every earlier prompt, the one output token each
    produced, and the new question (SGLang ``bench_multiturn``, output length 1).
    """

    client_id: int
    first_prompt: list[int]
    questions: list[list[int]]
    output_tokens: list[int]
    history: list[int] = field(default_factory=list)
    round: int = 0

    @property
    def num_rounds(self) -> int:
        return 1 + len(self.questions)

    def next_prompt(self) -> list[int]:
        """The prompt of the current round (history plus this round's new tokens)."""
        new = self.first_prompt if self.round == 0 else self.questions[self.round - 1]
        return self.history + new

    def complete_round(self, prompt: list[int]) -> None:
        """Record that this round's prompt was answered with its one output token."""
        self.history = prompt + [self.output_tokens[self.round]]
        self.round += 1

    @property
    def done(self) -> bool:
        return self.round >= self.num_rounds


def make_conversations(
    num_clients: int,
    num_rounds: int,
    request_length: int,
    sub_question_input_length: int,
    vocab_size: int,
    seed: int,
) -> list[Conversation]:
    """Clients with random first prompts of ``request_length`` tokens and questions of
    ``sub_question_input_length`` tokens; token ids in ``[1, vocab_size)``."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab_size) for _ in range(n)]

    return [
        Conversation(
            client_id=c,
            first_prompt=tokens(request_length),
            questions=[tokens(sub_question_input_length) for _ in range(num_rounds - 1)],
            output_tokens=tokens(num_rounds),
        )
        for c in range(num_clients)
    ]


def working_set_tokens(conversations: list[Conversation]) -> int:
    """Tokens of KV the whole trace would keep if every final history stayed cached."""
    total = 0
    for conv in conversations:
        total += len(conv.first_prompt) + sum(len(q) for q in conv.questions) + conv.num_rounds
    return total


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """``num`` arrival offsets (seconds) of a Poisson process with ``rate`` per second;
    ``rate <= 0`` or infinite means all at time 0."""
    if rate <= 0 or rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def cached_prompts(
    num_requests: int,
    input_len: int,
    cached_fraction: float,
    num_prefixes: int,
    vocab_size: int,
    seed: int,
) -> list[list[int]]:
    """Long prompts whose first ``cached_fraction`` comes from one of ``num_prefixes`` shared
    prefixes (the upstream optimistic-prefill measurement: long inputs, ~80% cached)."""
    rng = random.Random(seed)
    prefix_len = int(input_len * cached_fraction)
    prefixes = [
        [rng.randrange(1, vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)
    ]
    return [
        prefixes[i % num_prefixes]
        + [rng.randrange(1, vocab_size) for _ in range(input_len - prefix_len)]
        for i in range(num_requests)
    ]
