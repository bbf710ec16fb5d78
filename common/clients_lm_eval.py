"""clients_check's lm-eval row: the server's prompt logprobs, as lm-eval scores multiple choice.

lm-eval asks for the loglikelihood of each answer after its question: `local-completions` sends the
question + answer as token ids to /v1/completions with `echo`, `logprobs` and `max_tokens: 1`, and
sums the logprobs of the answer's tokens. The same task is then run by lm-eval's own `hf` backend
(transformers, CPU, float32) on the same local model. The two must agree: every per-choice
loglikelihood within 1e-3, and the same accuracy.

The task is written to a temporary folder (a YAML file and a JSON-lines file of QUESTIONS) and
found with --include_path: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from .clients_check import Context, check, need
from .clients_tools import run_tool

TASK = "clients_check_mc"
TOLERANCE = 1e-3
QUESTIONS = [  # (question, choices, index of the right one)
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "black"], 2),
    ("Which animal barks?", ["cat", "cow", "fish", "dog"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("Which season is the coldest?", ["winter", "summer", "spring", "autumn"], 0),
    ("How many days are in a week?", ["five", "seven", "ten", "twelve"], 1),
    ("What is the opposite of hot?", ["warm", "loud", "cold", "fast"], 2),
    ("Which fruit is yellow and long?", ["apple", "grape", "cherry", "banana"], 3),
    ("What do you use to write on paper?", ["pen", "spoon", "shoe", "cup"], 0),
    ("Which is the largest ocean?", ["Atlantic", "Pacific", "Indian", "Arctic"], 1),
    ("What gas do people need to breathe?", ["helium", "neon", "oxygen", "argon"], 2),
    ("Which language is spoken in Spain?", ["German", "Dutch", "Polish", "Spanish"], 3),
    ("What is the color of grass?", ["green", "purple", "white", "orange"], 0),
    ("Where do fish live?", ["trees", "water", "deserts", "clouds"], 1),
    ("Which month comes after January?", ["March", "June", "February", "May"], 2),
    ("What does a thermometer measure?", ["weight", "speed", "length", "temperature"], 3),
]

TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return folder


def evaluate(ctx: Context, model: str, model_args: str, out: Path, tasks: Path, extra=()) -> dict:
    """One `lm-eval run`; returns {doc_id: [loglikelihood per choice]} and the accuracy."""
    run_tool(
        [
            "lm_eval",
            "run",
            "--model",
            model,
            "--model_args",
            model_args,
            "--tasks",
            TASK,
            "--include_path",
            str(tasks),
            "--output_path",
            str(out),
            "--log_samples",
            *extra,
        ],
        log_name=f"lm-eval-{model}.log",
        ctx=ctx,
    )
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    (results,) = out.rglob("results_*.json")
    lls = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        lls[s["doc_id"]] = [float(r[0]) for r in s["filtered_resps"]]  # (loglikelihood, is_greedy)
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return {"loglikelihoods": lls, "acc": acc}


@check("lm-eval", f"local-completions vs hf, {len(QUESTIONS)}-question multiple choice")
def lm_eval_vs_hf(ctx: Context) -> str:
    need("lm_eval", "lm-eval")
    tasks = write_task(ctx.workdir / "lm-eval-task")
    server = evaluate(
        ctx,
        "local-completions",
        f"base_url={ctx.url}/v1/completions,model={ctx.model},tokenizer={ctx.model_path},"
        "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
        ctx.workdir / "lm-eval-server",
        tasks,
        extra=("--batch_size", "4"),
    )  # 4 prompts a request
    hf = evaluate(
        ctx,
        "hf",
        f"pretrained={ctx.model_path},dtype=float32",
        ctx.workdir / "lm-eval-hf",
        tasks,
        extra=("--device", "cpu", "--batch_size", "1"),
    )
    assert (
        server["loglikelihoods"].keys() == hf["loglikelihoods"].keys()
    ), "different questions scored"
    diffs = [
        abs(a - b)
        for doc in hf["loglikelihoods"]
        for a, b in zip(server["loglikelihoods"][doc], hf["loglikelihoods"][doc], strict=True)
    ]
    worst = max(diffs)
    print(f"    lm-eval loglikelihood per choice, server / hf (* the right answer):")
    for doc, (question, choices, answer) in enumerate(QUESTIONS):
        pairs = [
            f"{'*' if i == answer else ''}{c} {a:.4f} / {b:.4f}"
            for i, (c, a, b) in enumerate(
                zip(choices, server["loglikelihoods"][doc], hf["loglikelihoods"][doc])
            )
        ]
        print(f"    {question:40} {'; '.join(pairs)}")
    summary = (
        f"{len(diffs)} loglikelihoods, max |server - hf| {worst:.1e}; "
        f"acc server {server['acc']:.3f}, hf {hf['acc']:.3f}"
    )
    assert len(diffs) == sum(len(c) for _, c, _ in QUESTIONS), f"{len(diffs)} loglikelihoods scored"
    assert worst <= TOLERANCE, f"{summary} (over {TOLERANCE})"
    assert server["acc"] == hf["acc"], f"{summary}: accuracies differ"
    return summary
