"""Diagnosis commands of TROUBLESHOOTING.md: run a stage (or your copy of it) and say what is wrong.

    python -m common.diagnose golden N [--model M] [--dtype D] [--copy] [--option K=V] [--case C]
        every golden prompt against transformers' stored output: identical, or the first diverging
        step, the tokens there and the reference's logit margin (a near tie, or a real bug)
    python -m common.diagnose compare N --option K=V [...]
        the golden prompts with and without the options (disable_radix_cache=true,
        kv_cache=growing, disable_cuda_graph=true, ...): the first step where they differ
    python -m common.diagnose roundtrip [--model M] TEXT ...
        encode then decode, and the same ids decoded one at a time as a stream would
    python -m common.diagnose pages N [--option K=V ...]
        cancel two streams, finish a request, then: KV pages still used, the radix tree's locked
        and evictable tokens, check_integrity

    python -m common.diagnose grammar N [--schema JSON | --regex R] [--text T]
    python -m common.diagnose server N
        the server's diagnoses (stage 8 on): see common/diagnose_server.py

N is a stage number; --copy runs your copy (python -m common.exercises) instead: in exercises/, in
$SGLZ_EXERCISES_DIR, or in the folder given (--copy DIR, the same as the exercises tool's --dir).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from common.golden import compare, load_golden
from common.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent


def stage_package(number: int, copy: bool):
    from common.bug_hunts import import_copy
    from common.stages import find_stages

    name = next(s.name for s in find_stages(ROOT) if s.number == number)
    if not copy:
        return importlib.import_module(name)
    # the same place as the exercises tool's: --copy DIR, else $SGLZ_EXERCISES_DIR, else exercises/
    base = Path(copy) if isinstance(copy, str) else Path(
        os.environ.get("SGLZ_EXERCISES_DIR") or ROOT / "exercises")
    folder = base / name
    if not (folder / name).is_dir():
        raise SystemExit(f"no copy of {name} in {folder}: python -m common.exercises bug {number}")
    return import_copy(folder, name)


def parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        low = value.lower()
        options[key] = (True if low == "true" else False if low == "false" else
                        int(value) if value.lstrip("-").isdigit() else value)
    return options


def load_llm(pkg, model: str, dtype: str, options: dict):
    number = int(pkg.__name__.split("_")[0].removeprefix("stage"))
    quiet = {"verbose": False} if number >= 3 else {}
    return pkg.LLM(str(resolve_model(model)), dtype=dtype, **quiet, **options)


def golden_tokens(pkg, model: str, dtype: str, options: dict,
                  cases: list[str]) -> tuple[dict, list[list[int]]]:
    golden = load_golden(model, dtype)
    if cases:  # only the prompts named
        golden["cases"] = [c for c in golden["cases"] if c["name"] in cases]
    llm = load_llm(pkg, model, dtype, options)
    params = pkg.SamplingParams(max_new_tokens=golden["max_new_tokens"], temperature=0.0)
    results = llm.generate([c["prompt"] for c in golden["cases"]], params)
    return golden, [list(r.token_ids) for r in results]


def cmd_golden(args) -> int:
    pkg = stage_package(args.stage, args.copy)
    golden, outs = golden_tokens(pkg, args.model, args.dtype, parse_options(args.option),
                                args.case)
    bad = 0
    for case, got in zip(golden["cases"], outs):
        cmp = compare(got, case["output_ids"], case["margins"], golden["tie_margin"])
        bad += not cmp.ok
        print(f"{'ok  ' if cmp.ok else 'FAIL'} {case['name']:<10} {cmp.message}")
    print(f"{pkg.__name__} on {args.model} ({args.dtype}): {bad} of {len(outs)} prompts differ "
          "from transformers' (a step-0 difference: the prefill; later: the cache or decode)")
    return 1 if bad else 0


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cmd_compare(args) -> int:
    pkg = stage_package(args.stage, args.copy)
    changed = parse_options(args.option)
    golden, base = golden_tokens(pkg, args.model, "float32", {}, args.case)
    _, other = golden_tokens(pkg, args.model, "float32", changed, args.case)
    differ = 0
    for case, a, b in zip(golden["cases"], base, other):
        step = first_difference(a, b)
        differ += step is not None
        print(f"{case['name']:<10} " + ("identical" if step is None else
              f"differ from step {step}: {a[step:step + 3]} vs {b[step:step + 3]}"))
    print(f"with {changed}: {differ} of {len(base)} prompts differ (a correct engine: none, "
          "except on a near tie)")
    return 1 if differ else 0


def cmd_roundtrip(args) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))
    bad = 0
    for text in args.text:
        ids = tok.encode(text, add_special_tokens=False)
        back = tok.decode(ids)
        pieces = [tok.decode([i]) for i in ids]
        bad += back != text
        print(f"{text!r} -> {len(ids)} ids {ids[:12]}{' ...' if len(ids) > 12 else ''}")
        print(f"  decode: {'identical' if back == text else repr(back)}; one token at a time: "
              f"{pieces[:12]} ({sum(chr(0xFFFD) in p for p in pieces)} half characters)")
    specials = {t: tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    print(f"special tokens: {json.dumps(specials, ensure_ascii=False)}")
    return 1 if bad else 0


def cmd_pages(args) -> int:
    pkg = stage_package(args.stage, args.copy)
    options = dict({"max_total_tokens": 512, "attention_backend": "torch"},
                   **parse_options(args.option))
    llm = load_llm(pkg, args.model, "float32", options)
    params = pkg.SamplingParams(max_new_tokens=20, ignore_eos=True)
    # prompts longer than a page (16 tokens), so that full pages reach the radix tree (stage 6 on)
    first, second = [3, 1, 4, 1, 5, 9, 2, 6] * 5, [5, 6, 7, 8] * 9
    stream = llm.stream([first, second], params)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # a client that stops reading: both requests are aborted
    llm.generate([first + [7]], pkg.SamplingParams(max_new_tokens=4, ignore_eos=True))
    cache = llm.scheduler.cache
    print(f"after 2 cancelled streams and 1 finished request, nothing running: "
          f"{cache.num_used_pages} KV pages used")
    tree = getattr(cache, "tree", None)
    if tree is not None:
        print(f"radix tree: {tree.protected_size} tokens locked (must be 0), "
              f"{tree.evictable_size} evictable")
    try:
        llm.scheduler.check_integrity()
        print("check_integrity: ok")
    except AssertionError as e:
        print(f"check_integrity: FAILED: {e}")
        return 1
    leaked = cache.num_used_pages - (tree.evictable_size // cache.page_size if tree else 0)
    return 1 if leaked > 0 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.diagnose", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("golden", cmd_golden), ("compare", cmd_compare), ("pages", cmd_pages)):
        p = sub.add_parser(name)
        p.add_argument("stage", type=int)
        p.add_argument("--model", default="tiny-llama")
        p.add_argument("--copy", nargs="?", const=True, default=False, metavar="DIR",
                       help="your copy (in exercises/, $SGLZ_EXERCISES_DIR or DIR)")
        p.add_argument("--option", action="append", default=[], metavar="K=V")
        p.add_argument("--case", action="append", default=[], help="only this golden prompt "
                       "(english, code, chinese, chat, one_token, long); repeatable")
        p.set_defaults(fn=fn)
    sub.choices["golden"].add_argument("--dtype", default="float32",
                                       choices=["float32", "bfloat16"])
    p = sub.add_parser("roundtrip")
    p.add_argument("text", nargs="+")
    p.add_argument("--model", default="tiny-llama")
    p.set_defaults(fn=cmd_roundtrip)
    from common.diagnose_server import DEFAULT_SCHEMA, cmd_grammar, cmd_server

    p = sub.add_parser("grammar", help="the request's grammar alone: complete? end-of-text allowed?")
    p.add_argument("stage", type=int)
    p.add_argument("--schema", default=DEFAULT_SCHEMA, help="a JSON schema (default: name, age)")
    p.add_argument("--regex", default=None)
    p.add_argument("--text", default='{"name": "Ada", "age": 36}', help="the expected output")
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--copy", nargs="?", const=True, default=False, metavar="DIR",
                       help="your copy (in exercises/, $SGLZ_EXERCISES_DIR or DIR)")
    p.set_defaults(fn=cmd_grammar)
    p = sub.add_parser("server", help="start the server, its info and processes, SIGTERM it")
    p.add_argument("stage", type=int)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--copy", nargs="?", const=True, default=False, metavar="DIR",
                       help="your copy (in exercises/, $SGLZ_EXERCISES_DIR or DIR)")
    p.set_defaults(fn=cmd_server)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
