"""NGRAM drafts: text often repeats itself (code being edited, a quoted passage, a list that follows
a pattern). If the last few tokens appeared before in the request's prompt or output, guess that
what followed them then follows them again.

    tokens:  ... the cat sat on the mat . the cat sat [?]
                         ^^^^^^^^^^^ earlier match    ^^^^^^^^^^^ suffix
    draft:   on the mat .       (the tokens after the earlier match, at most k)

No second model and no KV cache: the proposal is a search over host token ids. A suffix that
never appeared before gives no draft, and that request decodes one token as usual.
"""

from __future__ import annotations

# The suffix must match at least this many tokens (a single repeated token is too weak a hint) and
# is extended backwards up to the longer one, which picks among several earlier occurrences.
MIN_MATCH, MAX_MATCH = 2, 8


def propose_ngram(tokens: list[int], k: int, min_match: int = MIN_MATCH,
                  max_match: int = MAX_MATCH) -> list[int]:
    """-> up to k tokens that followed the most recent, longest earlier occurrence of the suffix of
    `tokens` (at least min_match tokens long); [] when there is none."""
    n = len(tokens)
    if k < 1 or n < min_match + 1:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    # scan earlier positions from the most recent back; i is where a copy of the last token sits
    for i in range(n - 2, -1, -1):
        if tokens[i] != last:
            continue
        m = 1  # how many tokens match, counting back from i and from the end
        while m < max_match and i - m >= 0 and tokens[i - m] == tokens[n - 1 - m]:
            m += 1
        if m > best_len:
            best_len, best_end = m, i
            if m == max_match:
                break
    if best_len < min_match:
        return []
    return tokens[best_end + 1 : best_end + 1 + k]
