"""Optimistic constrained decoding: a row under a grammar samples as a free row, and the
grammar checks the token afterwards; only a refused token costs a mask.

Why: a grammar's mask costs ~20-60 us of CPU a row a step (llguidance, a JSON schema,
a 49k vocabulary), and a step needs every mask before it samples, so with every request
constrained the masks, not the forward, set the pace (bench/RESULTS.md, issue 41). A
model asked for JSON mostly picks tokens the grammar admits; checking one token costs
~2 us. So a row that may (``eligible``) samples unmasked, inside the fused multi-step
launch and the lookahead loops like any free row; processing has its grammar take its
tokens in order (``GrammarMatcher.take``, one library call for a step's tokens). At the
first refused token the row is rewound (``core.step_results.rewind``): that token and the row's later ones are dropped, and the
position is sampled again, under its mask, in the row's next step. llama.cpp's sampler
does the same by default (the grammar checks the sampled token, and the full mask is
applied only when it is refused).

Exactness. Greedy: an admissible argmax of the unmasked logits is the argmax of the
masked ones, so the tokens are those of masking first. Sampled, at temperature alone (no
top-k, top-p or min-p, which would be applied before the mask here and after it when
masking first): drawing t from p, keeping it if admissible, else drawing from p
restricted to the admissible set A, gives t in A with probability
p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A), the masked distribution, provided the redraw is
independent of the refused draw. Draws are keyed by (seed, generation index), so a rewound
row continues on a fresh seed (``runners.sampling.stream_seed``): the same request and seed
still give the same tokens in every loop. Rows asking for logprobs or hidden states mask
first (their values would be the unmasked distribution's).

A refusal costs the row a step (its position sampled again) and the forwards it ran past
the refused token; an admission saves a mask. Where refusals are frequent (a model that
does not follow the grammar, random weights, a schema of many forced positions) that loses
(bench/RESULTS.md: twice the steps on this VM's tiny random model), so each row keeps an
admission score, the share of its recent guesses admitted (``scored``): while it is at
least ``LOW_SCORE`` a refusal masks its one position; below it, the positions masked after
each refusal double (2, 4, ... ``LONGEST_MASKED_RUN``, ``masked_run``), so a row that
keeps being refused spends one refused guess per run of masked tokens. A prefill's token is
always masked first: its recomputation would rewrite a prompt page the prefix cache may
share.
"""

from __future__ import annotations

from typing import Any

# A generation index no request reaches: "mask every position" (not eligible).
NEVER = 1 << 62
LONGEST_MASKED_RUN = 64
# The admission score: the weight of the past in each update (about the last 8 guesses
# count), and the score below which refused rows mask runs of positions.
SCORE_KEEP = 0.875
LOW_SCORE = 0.75
# A row's score before its first guess: just above LOW_SCORE, so a row refused from the
# start (a model that ignores the grammar) masks runs after its first refusal, and one
# admitted as it goes keeps guessing through a refusal (0.8 -> 0.825 -> ... -> ~0.95).
FIRST_SCORE = 0.8


def enabled(config: Any) -> bool:
    """Whether a stage's eligible requests sample first: ``optimistic_grammar`` (as the plan
    settled it: on CUDA unless given), never with ``jump_forward``, which reads every next
    mask to find forced tokens."""
    return bool(config.optimistic_grammar) and not config.jump_forward


def eligible(sampling: Any, conditioning: Any = None) -> bool:
    """Whether a request under a grammar may sample first and check after: greedy, or
    sampled at temperature alone; no logprobs or hidden states read off its rows; not a
    conditioned request (its positions take rows from outside)."""
    sp = sampling
    if sp.return_logprob or sp.top_logprobs or sp.return_hidden_states or conditioning is not None:
        return False
    return sp.temperature == 0.0 or (sp.top_k == 0 and sp.top_p >= 1.0 and sp.min_p <= 0.0)


def scored(score: float, admitted: bool) -> float:
    """A row's admission score after one more guess (``FIRST_SCORE`` before any)."""
    return score * SCORE_KEEP + (1.0 - SCORE_KEEP if admitted else 0.0)


def optimistic_score(score: float, admitted: int, refused: bool) -> float:
    """The score after ``admitted`` guesses admitted in a row, then one refused if
    ``refused``: :func:`scored` applied to each, in closed form."""
    score = 1.0 - (1.0 - score) * SCORE_KEEP ** admitted
    return score * SCORE_KEEP if refused else score


def guessed_forwards(score: float, most: int) -> int:
    """Forwards a row sampling first runs in one launch: the most whose last token is at
    least as likely kept as not (``score ** n >= 1/2``, the score standing for each guess's
    chance of admission), at least one, at most ``most``. Why: a row keeps its tokens
    only up to its first refused one, and a launch runs its longest row's forwards for
    every row, so a row guessing k forwards where the grammar keeps refusing (a model that
    ignores it) had the device compute ~3 row-forwards a kept token at k = 8
    (tools/constrained_steps.py; bench/RESULTS.md, issue 61). A row whose guesses are
    mostly admitted (a model asked for JSON: a score of 0.92 or more) keeps k = 8; a fresh
    row (``FIRST_SCORE``) runs 3. Tokens do not depend on it: a draw is keyed by its
    generation index and the score moves token by token."""
    n, kept = 1, score * score
    while n < most and kept >= 0.5:
        n += 1
        kept *= score
    return n


def masked_run(score: float, low_refusals: int) -> int:
    """Positions masked first after a refusal, the refused one included: one while the
    score is high; else ``2 ** low_refusals`` (the refusals since it fell below
    ``LOW_SCORE``, this one included), at most ``LONGEST_MASKED_RUN``."""
    if score >= LOW_SCORE:
        return 1
    return min(1 << min(low_refusals, 16), LONGEST_MASKED_RUN)
