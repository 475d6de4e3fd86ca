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
    # issue 73: a window drawn ahead and weighed by its tokens, an optimizer with modes, a loop that steps
    # at step % k == 0 (with k > 1: its batch size raised to 32, as its comment invites)
    "autoregressive": ("gradient_accumulation_for_autoregressive_models.py",
                       ["--gradient_accumulation_steps", "2"], []),
    "autoregressive local count": ("gradient_accumulation_for_autoregressive_models.py",
                                   ["--gradient_accumulation_steps", "2"], []),
    "autoregressive not times processes": ("gradient_accumulation_for_autoregressive_models.py",
                                           ["--gradient_accumulation_steps", "2"], []),
    "autoregressive not times steps": ("gradient_accumulation_for_autoregressive_models.py",
                                       ["--gradient_accumulation_steps", "2"], []),
    "autoregressive shifted count": ("gradient_accumulation_for_autoregressive_models.py",
                                     ["--gradient_accumulation_steps", "2"], []),
    "schedule_free": ("schedule_free.py", [], []),
    "multi_process_metrics bs32": ("multi_process_metrics.py", [], ["--num-steps", "2"]),
    "multi_process_metrics bs32 fixed": ("multi_process_metrics.py", [], ["--num-steps", "2"]),
}
# One-line changes a user could make, applied to a copy of the script in the bench's working directory
# (the checkout is never changed, nothing is copied into this project): each ``old`` occurs once.
AUTOREGRESSIVE_LOSS = "loss = loss * gradient_accumulation_steps * accelerator.num_processes"
BATCH_32 = ('"batch_size": 16}', '"batch_size": 32}')
# as the model's loss counts: each row's first label is never predicted (transformers PR #46204,
# accelerate PR #4303); the example as shipped counts it, and the planted variants start from this fix
SHIFTED_COUNT = ('(batch["labels"].ne(-100)).sum()', '(batch["labels"][..., 1:].ne(-100)).sum()')
EDITS: dict[str, tuple[tuple[str, str], ...]] = {
    "autoregressive shifted count": (SHIFTED_COUNT,),
    "autoregressive local count": (SHIFTED_COUNT, (
        "num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()",
        "num_items_in_batch = local_num_items_in_batch.item()")),
    "autoregressive not times processes": (SHIFTED_COUNT, (AUTOREGRESSIVE_LOSS,
                                                           "loss = loss * gradient_accumulation_steps")),
    "autoregressive not times steps": (SHIFTED_COUNT, (AUTOREGRESSIVE_LOSS, "loss = loss * accelerator.num_processes")),
    "multi_process_metrics bs32": (BATCH_32,),
    "multi_process_metrics bs32 fixed": (BATCH_32, ("if step % gradient_accumulation_steps == 0:",
                                                    "if (step + 1) % gradient_accumulation_steps == 0:")),
}
# Runs whose windows need more than the 32 training rows of the stand-in data (a batch of 16 at world
# size 2 is one batch a rank an epoch)
ROWS = {"multi_process_metrics bs32": 128, "multi_process_metrics bs32 fixed": 128}
DEFAULT = ("gradient_accumulation", "multi_process_metrics", "checkpointing", "tracking", "local_sgd",
           "ddp_comm_hook fp16", "autoregressive", "schedule_free", "multi_process_metrics bs32",
           "multi_process_metrics bs32 fixed")
WORDS = ("the", "court", "said", "shares", "rose", "fell", "company", "percent", "market", "on", "tuesday",
         "analysts", "expected", "profit", "quarter", "bank", "deal", "price", "investors", "report")


def tiny_bert(directory: Path, *, hidden: int = 32, layers: int = 2, heads: int = 2, intermediate: int = 64) -> None:
    """A BERT sequence classifier small enough for CPU (two layers of width 32 unless told), and its
    tokenizer, as ``from_pretrained`` reads a checkpoint (config, weights, vocabulary)."""
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
    config = BertConfig(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=intermediate, max_position_embeddings=64)
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


def tiny_smollm(directory: Path) -> None:
    """A causal LM small enough for CPU (a Llama of two layers of width 32, random weights) and a
    tokenizer of the stand-in data's words with an end of sequence, as ``from_pretrained`` reads
    ``HuggingFaceTB/SmolLM-360M``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocabulary = {word: n for n, word in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    words = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            model_max_length=32).save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocabulary), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)


def offline_workdir(root: Path, rows: int = 32) -> dict[str, str]:
    """The stand-ins in ``root`` (``rows`` training sentence pairs), and the environment the scripts run
    offline with."""
    tiny_bert(root / "bert-base-cased")
    tiny_smollm(root / "HuggingFaceTB" / "SmolLM-360M")
    samples = root / "tests" / "test_samples" / "MRPC"
    samples.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train.csv", rows, 1), ("dev.csv", 8, 2)):
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
    script = examples / name
    if label in EDITS:  # a planted variant: the script's copy, in the working directory, with its edits
        text = script.read_text(encoding="utf-8")
        for old, new in EDITS[label]:
            if text.count(old) != 1:
                raise SystemExit(f"accelerate_examples: {name} holds {text.count(old)} of {old!r}; the run "
                                 f"{label!r} needs it once")
            text = text.replace(old, new)
        script = workdir / "planted" / label.replace(" ", "_") / name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "harness", "watch", str(script), "--world-sizes", world_sizes,
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
        workdirs: dict[int, tuple[Path, dict[str, str]]] = {}  # by the stand-in data's training rows
        print("| run | world size | status | first step found wrong | summary |")
        print("| --- | --- | --- | --- | --- |")
        for label in labels:
            rows = ROWS.get(label, 32)
            if rows not in workdirs:
                workdir = Path(tmp) / f"rows-{rows}"
                workdir.mkdir()
                workdirs[rows] = (workdir, {} if args.online else offline_workdir(workdir, rows))
            workdir, env = workdirs[rows]
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
