"""Incremental detokenization: turn one token at a time into text deltas that never split a UTF-8
character, and find stop strings even when they span several tokens.

Why not decode each token alone? A byte-level BPE token can hold half of a multi-byte character (one
Chinese character is often two or three tokens): decoding it alone gives U+FFFD "�". And decoding a
token without its left neighbours can change spaces. So we decode a small window: the text of
ids[prefix_offset:] minus the text of ids[prefix_offset:read_offset], and only when it does not end
in "�" (an incomplete character) do we accept it and move the window forward (the scheme of SGLang's
detokenizer manager and Hugging Face's TextStreamer).

A room of its own rather than part of a tokenizer module: it is per-request state, and in stage 8 it
moves into the detokenizer process, as in SGLang.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop_strings: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.ids: list[int] = []
        self.prefix_offset = 0  # decode window start: context for the tokens being read
        self.read_offset = 0  # ids before this are already in self.text
        # complete characters decoded so far (trimmed at a stop string once one matched)
        self.text = ""
        self.sent = 0  # characters of self.text already handed out as deltas
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completed, if any (the text is
        then trimmed)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            searched = len(self.text)
            self.text += full_text[len(prefix_text) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return self._find_stop(searched)
        return None

    def _find_stop(self, searched: int) -> str | None:
        # A stop string may straddle the old text and the new: search from len(stop) - 1 characters
        # back.
        best = None
        for stop in self.stop_strings:
            idx = self.text.find(stop, max(0, searched - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        # the stop string is not part of the output (SGLang / OpenAI semantics)
        self.text = self.text[: best[0]]
        self.matched_stop = best[1]
        return best[1]

    def _held_back(self) -> int:
        """Characters at the end that might be the start of a stop string: not safe to stream
        yet."""
        for n in range(min(len(self.text),
                           max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0

    def take_delta(self, final: bool = False) -> str:
        """The text not handed out yet; holds back a possible stop-string prefix unless the request
        is final."""
        if final and self.read_offset < len(self.ids) and self.matched_stop is None:
            # The request ended inside a character: show what there is (U+FFFD), as a full decode
            # would.
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self.sent)
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
