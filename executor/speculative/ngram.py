"""Prompt lookup (vLLM's `ngram` method): the request's last n tokens, for the longest
n in [min, max] that occurred before, are matched at their earliest occurrence, and
the tokens that followed it there are the draft. No model, no state: numpy over the
request's own tokens (prompt and output so far)."""

import numpy as np

_NO_TOKEN = -1  # left padding: equal to no token id


def propose_ngram(token_ids: np.ndarray, num_drafts: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to num_drafts tokens (fewer near the end of the match, none without one)."""
    num_tokens = len(token_ids)
    if num_tokens < 2 or num_drafts <= 0:
        return token_ids[:0]
    padded = np.concatenate((np.full(max_n, _NO_TOKEN, token_ids.dtype), token_ids))
    # same[m, e]: the token m before candidate end e equals the m-th token from the
    # end, for every end e of an earlier occurrence (before the last token); the run
    # of leading Trues down a column is the length of the suffix that ends there.
    ends = np.arange(max_n, max_n + num_tokens - 1)
    back = np.arange(max_n)[:, None]
    same = padded[ends[None, :] - back] == padded[max_n + num_tokens - 1 - back]
    match_len = np.cumprod(same, axis=0).sum(axis=0)
    longest = int(match_len.max())
    if longest < min_n:
        return token_ids[:0]
    start = int(np.argmax(match_len == longest)) + 1  # the earliest, in token positions
    return token_ids[start : start + num_drafts]
