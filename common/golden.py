"""The golden-output harness: Hugging Face transformers' greedy outputs, stored, and the rule for comparing.

A golden file (tests/golden/<model>.json) holds, for each prompt: the prompt ids, the reference's generated ids
(greedy, float32, CPU) and, for every generated step, the reference's top-2 logit margin (top1 - top2).

Comparison rule: tokens must be identical. At the first differing step the divergence is accepted only if the
reference's margin there is below TIE_MARGIN, a genuine tie that float32 rounding in another (correct) summation
order may flip; after an accepted tie the two continuations are different texts and are not compared further.

    python -m common.golden regenerate [MODEL ...]     rebuild the files from transformers
    python -m common.golden regenerate --dtype bfloat16 smollm2-135m-instruct   the bfloat16 reference
    python -m common.golden bf16-spread                two bfloat16 runs of transformers: how far their margins differ
    python -m common.golden show MODEL                 print prompts, outputs and the smallest margins
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden"
GOLDEN_MODELS = ["smollm2-135m-instruct", "tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-mistral",
                 "tiny-qwen3-moe", "tiny-mixtral"]
# float32 logits of these models are O(10); two correct implementations differ by ~1e-5 there.
TIE_MARGIN = 1e-3
# bfloat16 keeps 8 bits of mantissa: a logit in [16, 32) is a multiple of 0.125, and every layer's activations are
# rounded like that, so two correct bfloat16 implementations (other kernels, other summation orders) disagree on a
# top-2 margin by several such steps. Measured (`python -m common.golden bf16-spread`, teacher-forced along the
# bfloat16 reference): transformers' own sdpa and eager attention, both bfloat16, move a margin by up to 0.625 on
# SmolLM2's golden prompts. A bfloat16 golden file accepts a first divergence only where the reference's margin is
# below that.
BF16_TIE_MARGIN = 0.625
GOLDEN_DTYPES = {"float32": TIE_MARGIN, "bfloat16": BF16_TIE_MARGIN}

_LONG_TEXT = (
    "The lighthouse keeper wrote in his log every evening. He noted the wind, the colour of the sea, the ships "
    "that passed and the birds that rested on the gallery rail. In winter the entries were short: storm, fog, "
    "no ships. In summer they grew into small essays about the fishermen, the tourists who climbed the stairs, "
    "and the slow work of polishing the great lens. "
)


def prompt_specs(tokenizer) -> list[dict]:
    """The golden prompts. `prompt` is what the harness passes to a stage: text, or ids where text can't say it."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    specs = [
        {"name": "english", "prompt": "The three most important inventions of the nineteenth century were"},
        {"name": "code", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
        {"name": "chinese", "prompt": "人工智能的发展历史可以追溯到"},
        {"name": "chat", "prompt": tokenizer.encode(chat, add_special_tokens=False)},
        {"name": "one_token", "prompt": tokenizer.encode("Once", add_special_tokens=False)[:1]},
        {"name": "long", "prompt": (_LONG_TEXT * 5) + "Summarise the keeper's log in one sentence:"},
    ]
    for spec in specs:
        p = spec["prompt"]
        spec["input_ids"] = tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
    return specs


def max_new_tokens_for(model: str) -> int:
    return 100 if model.startswith("smollm2") else 40


def hf_reference(hf_model, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by a transformers model (float32, CPU): (generated ids, per-step top-2 margins)."""
    import torch

    eos = hf_model.generation_config.eos_token_id
    pad = eos if isinstance(eos, int) else (eos or [0])[0]
    out = hf_model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                            temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=pad,
                            output_logits=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(input_ids):].tolist()
    margins = []
    for step_logits in out.logits:  # one [1, vocab] tensor per generated token
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return ids, margins


def golden_name(model: str, dtype: str = "float32") -> str:
    return model if dtype == "float32" else f"{model}-{dtype}"


def regenerate(model: str, dtype: str = "float32") -> Path:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from common.models import resolve_model

    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf_model = load_hf_model(path, dtype)
    n = max_new_tokens_for(model)
    cases = []
    for spec in prompt_specs(tokenizer):
        ids, margins = hf_reference(hf_model, spec["input_ids"], n)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cases.append({**spec, "output_ids": ids, "margins": [round(m, 6) for m in margins], "text": text})
        print(f"  {model}/{spec['name']}: {len(spec['input_ids'])} prompt tokens -> {len(ids)} tokens, "
              f"min margin {min(margins):.4f}")
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    out = GOLDEN_DIR / f"{golden_name(model, dtype)}.json"
    payload = {"model": model, "dtype": dtype, "max_new_tokens": n, "tie_margin": GOLDEN_DTYPES[dtype],
               "reference": f"transformers {transformers.__version__}, torch {torch.__version__}, {dtype}, CPU, greedy",
               "cases": cases}
    out.write_text(json.dumps(payload, ensure_ascii=False, indent=1) + "\n")
    return out


def load_hf_model(model_path: Path, dtype: str = "float32", attn_implementation: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype),
                                                attn_implementation=attn_implementation).eval()


def discover_stages() -> list[str]:
    """Every stage package that exists at the repo root, in course order: stage1_naive, stage2_batch, ..."""
    from common.stages import find_stages  # the one definition of what a stage folder is

    return [stage.name for stage in find_stages(GOLDEN_DIR.parent.parent)]


def bf16_spread(model: str) -> str:
    """Teacher-forced along the bfloat16 reference's tokens, transformers' sdpa and eager attention, both bfloat16
    (two correct implementations): how far apart their top-2 margins are at the same step, at most."""
    import torch

    from common.models import resolve_model

    golden = load_golden(model, "bfloat16")
    path = resolve_model(model)
    runs = [load_hf_model(path, "bfloat16", impl) for impl in ("sdpa", "eager")]
    worst = 0.0
    for case in golden["cases"]:
        ids = torch.tensor([case["input_ids"] + case["output_ids"]])
        with torch.no_grad():
            a, b = (m(ids).logits[0, len(case["input_ids"]) - 1 : -1].float() for m in runs)  # [steps, vocab]
        top2 = a.topk(2, dim=-1).indices  # [steps, 2]
        margin_a, margin_b = (x.gather(1, top2) @ torch.tensor([1.0, -1.0]) for x in (a, b))  # [steps]
        worst = max(worst, float((margin_a - margin_b).abs().max()))
    return f"{model}: largest top-2 margin difference, sdpa vs eager attention in bfloat16: {worst:.4f}"


def load_golden(model: str, dtype: str = "float32") -> dict:
    return json.loads((GOLDEN_DIR / f"{golden_name(model, dtype)}.json").read_text())


@dataclass
class Comparison:
    ok: bool
    matched: int  # identical leading tokens
    message: str


def compare(got: list[int], want: list[int], margins: list[float], tie_margin: float = TIE_MARGIN) -> Comparison:
    """Identical tokens, or a first divergence at a step where the reference itself was a near tie."""
    for i, w in enumerate(want):
        if i >= len(got):
            return Comparison(False, i, f"stopped after {len(got)} tokens, reference has {len(want)}")
        if got[i] != w:
            if margins[i] < tie_margin:
                return Comparison(True, i, f"diverged at step {i} on a tie (margin {margins[i]:.2e})")
            return Comparison(False, i, f"step {i}: got token {got[i]}, reference {w} "
                                        f"(reference margin {margins[i]:.4f} is no tie)")
    if len(got) > len(want):
        return Comparison(False, len(want), f"generated {len(got)} tokens, reference stopped at {len(want)}")
    return Comparison(True, len(want), "identical")


def failures(results, golden: dict) -> list[str]:
    """Check one generate() over all of a golden file's prompts (results in case order): an empty list, or what
    went wrong per case. Tokens by `compare`; where every token matched, the decoded text must match too."""
    problems = []
    for case, result in zip(golden["cases"], results, strict=True):
        cmp = compare(list(result.token_ids), case["output_ids"], case["margins"],
                      golden.get("tie_margin", TIE_MARGIN))
        if not cmp.ok:
            problems.append(f"{case['name']}: {cmp.message}")
        elif cmp.matched == len(case["output_ids"]) and result.text != case["text"]:
            problems.append(f"{case['name']}: same tokens but text {result.text!r} != {case['text']!r}")
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.golden", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    regen = sub.add_parser("regenerate", help="rebuild golden files with transformers")
    regen.add_argument("models", nargs="*", default=GOLDEN_MODELS)
    regen.add_argument("--dtype", default="float32", choices=sorted(GOLDEN_DTYPES))
    spread = sub.add_parser("bf16-spread", help="how far two bfloat16 runs of transformers (sdpa and eager "
                                                "attention) differ at the LM head on the golden prompts")
    spread.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    show = sub.add_parser("show", help="print a golden file")
    show.add_argument("model")
    args = parser.parse_args(argv)
    if args.cmd == "regenerate":
        for model in args.models:
            print(f"wrote {regenerate(model, args.dtype)}")
    elif args.cmd == "bf16-spread":
        print(bf16_spread(args.model))
    else:
        golden = load_golden(args.model)
        for case in golden["cases"]:
            print(f"--- {case['name']} ({len(case['input_ids'])} prompt tokens, min margin {min(case['margins']):.4f})")
            print(case["text"])


if __name__ == "__main__":
    main()
