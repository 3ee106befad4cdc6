"""Jump-forward: the tokens a grammar forces appended at once, their KV computed in the next step.

Why: in a JSON schema most positions admit exactly one token (the keys, the punctuation);
decoded one by one, each costs a whole step of its request (two under the lookahead
loops with jump-forward on: a row with a token in flight then waits, as processing may
append forced tokens; without it, late masks let it join every one-forward step,
``core.multi_step.late_mask_rows``). Where the matcher admits one
token, the sample is determined whatever the logits say, so the token is appended to the
output right after the token that led there, with the matcher advanced; the request then
has several tokens without KV, computed in its next step as one row of several positions
(``core.multi_step``: inputs fed into the fused launch; a mixed extend step when the
step runs one forward), which samples after the last of them. The tokens equal those of
token-by-token constrained decoding, greedy or sampled: a draw's stream is indexed by the
token's position, not by the steps taken.

Not for a request that reads something off every position (logprobs, hidden states),
whose OpenAI penalties, bias or suppressed tokens could make the forced token
inadmissible, or where the forced token is a stop id (its rules stay with the step).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def can_jump(req: Any, hidden_for_all: bool = False) -> bool:
    """Whether ``req`` (under a grammar) may take its forced tokens without their forwards:
    not when something is read off each token's forward (logprobs, hidden states: its
    own ask, or ``hidden_for_all``, a stage that hands every row's hidden states on,
    one per token, to the next stage)."""
    sp = req.sampling
    return not (hidden_for_all or sp.return_logprob or sp.top_logprobs or sp.suppress_tokens or sp.has_logit_controls
                or sp.return_hidden_states or req.conditioning is not None)


def single_token(mask: np.ndarray) -> int | None:
    """The one token a ``[words]`` int32 bitmask admits, or None (none, or several)."""
    nz = np.flatnonzero(mask)
    if len(nz) != 1:
        return None
    word = int(mask[nz[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nz[0]) * 32 + word.bit_length() - 1


def jump_forward(req: Any, context_length: int, most: int) -> tuple[list[int], str | None]:
    """Append the run of tokens ``req``'s grammar forces now (at most ``most``), each
    accepted by its matcher as a sampled one would be: the tokens, and why the request
    ends with them (None: it runs on; "stop": the grammar completed; "error": it failed;
    "length": its limit). The caller has just appended the request's sampled token, and
    queues the row's next mask after this (the batch core's ``process_result``).

    The run comes from the library's forced-token query on the parser state
    (``GrammarMatcher.forced``: one call for the whole run, no mask), not from a mask per
    position: reading masks made the loop thread wait for the mask worker's whole ticket
    at every step and compute the mask after each forced token itself (bench/RESULTS.md,
    2026-12-05, issue 41). Each token of the run is the one token its position's mask
    admits (``tests/test_grammar_prefetch.py`` checks runs against the library's masks),
    so the tokens equal those of sampling under the masks."""
    matcher, out = req.matcher, req.output_ids
    stops = req.stop_ids()
    run: list[int] = []
    reason = None
    for token in matcher.forced():
        if len(run) >= most or token in stops:
            break
        out.append(token)
        run.append(token)
        if matcher.accept(token, prefetch=False):
            reason = "error" if matcher.failed else "stop"
            break
        if req.tokens_left(context_length, scheduling=False) <= 0:
            reason = "length"
            break
    if run:
        matcher.count_jump(len(run))
    return run, reason
