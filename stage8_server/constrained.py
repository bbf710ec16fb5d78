"""Structured outputs: the output follows a grammar (a JSON schema, a regular expression or an EBNF
grammar) whatever the model would rather say, because before every sampling step the tokens that
would break the grammar are taken out of the running.

    grammar text ──parse + compile, once per text, on a thread──▶ CompiledGrammar   (xgrammar)
    per request:  GrammarMatcher(compiled)       where this request's output stands in the grammar
    per step:     fill_next_token_bitmask        one bit per vocabulary id: may it come next?
                  apply_token_bitmask_inplace    the forbidden ids' logits -> -inf; then the sampler
                  accept_token(token)            advance by the token sampled
                  is_terminated()                complete, and its stop token taken: "stop"

xgrammar is SGLang's default grammar backend. Compiling is the expensive part: the compiler walks
the whole vocabulary once per grammar and records, for each position in the grammar, which tokens it
accepts (its "adaptive token mask cache"), tens of milliseconds for a small JSON schema over a 49k
vocabulary. That is why a grammar is compiled once per distinct text (the cache below), on a thread
pool (xgrammar's compiler releases the GIL, so the scheduler's loop keeps stepping meanwhile), and
why the per-step fill is cheap: a lookup in that cache for most tokens, a real check only for the
few that depend on the matcher's stack.

The bitmask is as wide as the model's logits (config.vocab_size). That may exceed the tokenizer's
vocabulary (lm_head rows padded to a round number): TokenizerInfo is told the model's width, treats
the ids past the tokenizer as never allowed, and the padding rows are masked like any forbidden
token.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate

import torch

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (least recently asked for dropped first)
# JSON: at most this many whitespace characters between two elements. Unbounded, a small model can
# emit newlines until max_tokens, each one allowed by the grammar; 16 still fits indented output.
MAX_WHITESPACE = 16
# xgrammar's JSON-schema parser grows steeply with nesting (0.24 s for 100 nested objects, 5 s for
# 300, over a minute for 900; xgrammar 0.2.9 on a 2-core CPU), so a grammar is bounded before it is
# parsed: by size, and a JSON schema by depth. JSON depth counts the schema's text: each nested
# object schema adds two ({ and "properties": {), so 64 allows some 30 levels of objects.
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_JSON_SCHEMA_DEPTH = 64
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _xgrammar():
    import xgrammar  # imported on the first grammar: importing the engine stays light

    return xgrammar


def clean_message(exc: BaseException) -> str:
    """xgrammar's C++ errors start with a timestamp, a source path, the failed check: keep words."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return text.replace("Check failed: (error.empty()) is false: ", "")


def json_depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (brackets inside strings do not count),
    without parsing it: json.loads itself would raise RecursionError past a thousand or so."""
    brackets = re.sub(r"[^\[\]{}]", "", JSON_STRING.sub("", text))
    steps = (1 if b in "[{" else -1 for b in brackets)
    return max(accumulate(steps, initial=0))


def check_grammar_limits(kind: str, text: str) -> None:
    """ValueError naming the limit if the grammar is too large, or a JSON schema too deep."""
    size = len(text.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{kind} is {size} bytes; the limit is {MAX_GRAMMAR_BYTES} "
                         "(MAX_GRAMMAR_BYTES)")
    if kind == "json_schema":
        depth = json_depth(text)
        if depth > MAX_JSON_SCHEMA_DEPTH:
            raise ValueError(f"json_schema nests {depth} levels of objects and arrays; the limit "
                             f"is {MAX_JSON_SCHEMA_DEPTH} (MAX_JSON_SCHEMA_DEPTH)")


def check_grammar_text(kind: str, text: str) -> None:
    """The checks that cost no more than reading the text: its size, and a JSON schema's depth and
    JSON syntax (ValueError naming the problem)."""
    check_grammar_limits(kind, text)
    if kind == "json_schema":
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid json_schema: not JSON ({exc})") from None


def parse_grammar(kind: str, text: str):
    """(kind, text) -> xgrammar.Grammar, or ValueError naming the problem. No vocabulary involved,
    but not always cheap (a deep schema within the limits still takes a fraction of a second):
    the server leaves it to the compile, on the grammar threads; the offline LLM runs it when a
    request is added, so that a bad grammar is refused by name at once."""
    xgr = _xgrammar()
    check_grammar_text(kind, text)
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(text, any_whitespace=True,
                                                max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"invalid {kind}: {clean_message(exc)}") from None
    raise ValueError(f"unknown grammar kind {kind!r}")


def check_grammar(params, parse: bool = True) -> None:
    """Refuse SamplingParams whose grammar is too large, too deep or (parse) does not parse
    (ValueError naming it); no grammar: nothing to do."""
    if params.grammar is not None:
        (parse_grammar if parse else check_grammar_text)(*params.grammar)


class GrammarBackend:
    """Compiles grammars for one tokenizer and logits width: on a thread pool, once per (kind,
    text); hands each request a matcher of its own (SGLang's BaseGrammarBackend +
    XGrammarGrammarBackend, in one)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids, num_threads: int = 2):
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.executor = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        # (kind, text) -> Future of its CompiledGrammar
        self.cache: dict[tuple[str, str], Future] = {}
        self._compiler = None
        self._lock = threading.Lock()
        # one entry per compile actually run (the cache's misses)
        self.compile_seconds: list[float] = []

    def get_future(self, key: tuple[str, str]) -> Future:
        """The compiled grammar of (kind, text), as a Future: done at once on a cache hit."""
        future = self.cache.pop(key, None)
        if future is None:
            if len(self.cache) >= GRAMMAR_CACHE_SIZE:
                oldest = next((k for k, f in self.cache.items() if f.done()), None)
                if oldest is not None:
                    del self.cache[oldest]
            future = self.executor.submit(self._compile, key)
        self.cache[key] = future  # (re)inserted last: the most recently used
        return future

    def compiler(self):
        """Built on the first compile, on the pool's thread: TokenizerInfo reads every token of the
        vocabulary (a fifth of a second for 49k tokens), which the scheduler's loop should not wait
        for either."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.hf_tokenizer,
                                                          vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1),
                                                     # the cache above is the one
                                                     cache_enabled=False)
            return self._compiler

    def _compile(self, key: tuple[str, str]):
        compiler = self.compiler()
        start = time.perf_counter()
        compiled = compiler.compile_grammar(parse_grammar(*key))
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def matcher(self, compiled):
        """A request's own position in a (shared) compiled grammar."""
        return _xgrammar().GrammarMatcher(compiled)

    def allocate_mask(self, batch_size: int) -> torch.Tensor:
        """[batch_size, ceil(vocab / 32)] int32 on the host, every bit set (all allowed)."""
        return _xgrammar().allocate_token_bitmask(batch_size, self.vocab_size)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def apply_grammar_mask(logits: torch.Tensor, bitmask: torch.Tensor,
                       rows: list[int]) -> torch.Tensor:
    """logits [S, vocab] (changed in place and returned): in each of `rows`, the ids whose bit is 0
    -> -inf. The other rows (unconstrained requests of the same batch) are left alone."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits
