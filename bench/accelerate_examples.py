"""accelerate's own ``examples/by_feature`` scripts, run unedited under ``python -m harness watch`` at
world sizes 1 and 2 on CPU (docs/script.md, "accelerate's own examples"), and a table of what the
harness found in each.

    pip install datasets evaluate           # what the examples import
    git clone https://github.com/huggingface/accelerate
    python bench/accelerate_examples.py --examples accelerate/examples/by_feature [--runs local_sgd,...]

The scripts are accelerate's, read from the checkout you give and run from it; none is copied into
this project. They fetch ``bert-base-cased``, GLUE's MRPC and its metric from the Hugging Face hub.
Where the hub cannot be reached (this machine, CI), the bench gives them local stand-ins under the
names the scripts use, in a working directory of their own, and sets the hub's offline switches:
``./bert-base-cased`` (a two-layer BERT of width 32 with random weights, and a WordPiece vocabulary of
single characters: ``from_pretrained`` takes a local directory of that name first), the data the
scripts' own ``TESTING_MOCKED_DATALOADERS`` path reads (the path accelerate's own tests run them
offline with: ``tests/test_samples/MRPC/{train,dev}.csv``, sentence pairs generated here), and
``./glue/glue.py`` (an ``evaluate`` metric of accuracy and F1 that ``evaluate.load("glue", "mrpc")``
takes as a local one). None of them touches a gradient: the checks are the harness's as for any script.
``--online`` runs the scripts with the hub instead (the real checkpoint, data and metric).

Each run is a script with its own arguments (``RUNS``: to accumulate where it has an option to, a
communication hook); the table gives each cell's status, the first step the harness found wrong with
its diagnoses, and the summary's head.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The runs: a label, the script, its own arguments, and the harness's (a loop that accumulates by hand
# under an Accelerator of one step needs --num-steps). The default set: the scripts that accumulate or
# reduce in their own way, and three that add only what leaves the gradients alone (metrics,
# checkpoints, trackers).
RUNS: dict[str, tuple[str, list[str], list[str]]] = {
    "gradient_accumulation": ("gradient_accumulation.py", ["--gradient_accumulation_steps", "2"], []),
    "automatic_gradient_accumulation": ("automatic_gradient_accumulation.py", [], []),
    "multi_process_metrics": ("multi_process_metrics.py", [], []),
    "checkpointing": ("checkpointing.py", ["--checkpointing_steps", "epoch"], []),
    "tracking": ("tracking.py", [], []),
    "memory": ("memory.py", [], []),
    "profiler": ("profiler.py", [], []),
    "early_stopping": ("early_stopping.py", [], []),
    "local_sgd": ("local_sgd.py", ["--gradient_accumulation_steps", "1", "--local_sgd_steps", "4"], []),
    "ddp_comm_hook": ("ddp_comm_hook.py", [], []),
    "ddp_comm_hook fp16": ("ddp_comm_hook.py", ["--ddp_comm_hook", "fp16"], []),
    "ddp_comm_hook power_sgd": ("ddp_comm_hook.py", ["--ddp_comm_hook", "power_sgd"], []),
    "cross_validation": ("cross_validation.py", ["--num_folds", "2"], []),
}
DEFAULT = ("gradient_accumulation", "multi_process_metrics", "checkpointing", "tracking", "local_sgd",
           "ddp_comm_hook fp16")
WORDS = ("the", "court", "said", "shares", "rose", "fell", "company", "percent", "market", "on", "tuesday",
         "analysts", "expected", "profit", "quarter", "bank", "deal", "price", "investors", "report")


def tiny_bert(directory: Path) -> None:
    """A BERT sequence classifier small enough for CPU, and its tokenizer, as ``from_pretrained`` reads
    a checkpoint (config, weights, vocabulary)."""
    import string

    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=False, model_max_length=48)
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForSequenceClassification(config).save_pretrained(directory)


def mrpc_rows(count: int, seed: int) -> list[dict[str, object]]:
    """Sentence pairs of a few words; the label says whether the second repeats the first's words."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        first = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        same = rng.random() < 0.5
        second = list(first) if same else [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
        rng.shuffle(second)
        rows.append({"label": int(same), "sentence1": " ".join(first), "sentence2": " ".join(second), "idx": index})
    return rows


METRIC = '''"""accuracy and F1 of binary predictions, under the name evaluate.load("glue", "mrpc") asks for"""
import datasets
import evaluate


class Glue(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="accuracy and F1", citation="", inputs_description="",
                                   features=datasets.Features({"predictions": datasets.Value("int64"),
                                                               "references": datasets.Value("int64")}))

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        hits = sum(p == r for p, r in pairs)
        true_positive = sum(p == r == 1 for p, r in pairs)
        predicted, actual = sum(p == 1 for p, _ in pairs), sum(r == 1 for _, r in pairs)
        f1 = 2 * true_positive / (predicted + actual) if predicted + actual else 0.0
        return {"accuracy": hits / max(len(pairs), 1), "f1": f1}
'''


def offline_workdir(root: Path) -> dict[str, str]:
    """The stand-ins in ``root``, and the environment the scripts run offline with."""
    tiny_bert(root / "bert-base-cased")
    samples = root / "tests" / "test_samples" / "MRPC"
    samples.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train.csv", 32, 1), ("dev.csv", 8, 2)):
        with open(samples / name, "w", newline="", encoding="utf-8") as out:
            writer = csv.DictWriter(out, fieldnames=["label", "sentence1", "sentence2", "idx"])
            writer.writeheader()
            writer.writerows(mrpc_rows(count, seed))
    (root / "glue").mkdir(exist_ok=True)
    (root / "glue" / "glue.py").write_text(METRIC, encoding="utf-8")
    return {"TESTING_MOCKED_DATALOADERS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_EVALUATE_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(root / "hf-home")}


def run(label: str, examples: Path, workdir: Path, env: dict[str, str], world_sizes: str,
        timeout: float) -> tuple[list[dict], float]:
    name, script_args, harness_args = RUNS[label]
    report = workdir / "reports" / label.replace(" ", "-")
    command = [sys.executable, "-m", "harness", "watch", str(examples / name), "--world-sizes", world_sizes,
               "--report-dir", str(report), *harness_args]
    if script_args:
        command += ["--", *script_args]
    started = time.monotonic()
    subprocess.run(command, cwd=workdir, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    matrix = report / "matrix.json"
    cells = json.loads(matrix.read_text())["cells"] if matrix.exists() else []
    return cells, time.monotonic() - started


def found(cell: dict) -> str:
    """The first step the harness found wrong and its diagnoses, or nothing."""
    failures = cell.get("failures") or []
    if not failures:
        return ""
    first = min(f["step"] for f in failures)
    return f"step {first}: " + ", ".join(sorted({f["kind"] for f in failures if f["step"] == first}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=Path, required=True, help="accelerate's examples/by_feature directory")
    parser.add_argument("--runs", default=",".join(DEFAULT),
                        help=f"comma list of the runs (default: {', '.join(DEFAULT)}; all: {', '.join(RUNS)})")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--online", action="store_true", help="the hub's checkpoint, data and metric, not stand-ins")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a script's run may take")
    args = parser.parse_args()
    labels = [s.strip() for s in args.runs.split(",") if s.strip()]
    unknown = [label for label in labels if label not in RUNS]
    present = {p.name for p in args.examples.glob("*.py")}
    missing = sorted({RUNS[label][0] for label in labels if label in RUNS} - present)
    if unknown or missing:
        print(f"accelerate_examples: {'unknown run ' + ', '.join(unknown) if unknown else ''}"
              f"{'no ' + ', '.join(missing) + ' in ' + str(args.examples) if missing else ''}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="accelerate-examples-") as tmp:
        workdir = Path(tmp)
        env = {} if args.online else offline_workdir(workdir)
        print("| run | world size | status | first step found wrong | summary |")
        print("| --- | --- | --- | --- | --- |")
        for label in labels:
            cells, seconds = run(label, args.examples, workdir, env, args.world_sizes, args.timeout)
            if not cells:
                print(f"| `{label}` | | no matrix | | the command wrote no report ({seconds:.0f} s) |")
            for cell in sorted(cells, key=lambda c: c["world_size"]):
                summary = cell["summary"].replace("|", "\\|")
                print(f"| `{label}` | {cell['world_size']} | {cell['status']} | {found(cell)} | {summary[:300]} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
