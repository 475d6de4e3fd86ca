"""transformers' Trainer checked step by step (harness/rank/trainer.py, cases/test_trainer.py): the
expectation against a float64 one-process computation over every rank's micro-batches, a planted
misconfiguration caught with its diagnosis, and the catalogue's Trainer cells on a real pool."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PLANTED, ROOT, Session, killed_if_failing, start_pytest

pytest.importorskip("transformers")

from harness.rank.hf_models import causal_lm  # noqa: E402  (after the skip: it builds transformers models)
from harness.rank.tokens import IGNORE_INDEX  # noqa: E402

TRAINER_CASES = PLANTED.replace("planted_cases.py", "trainer_cases.py")
# tests/planted/trainer_cases.py's settings
STEPS, BATCHES, EPOCHS, LR, MAX_NORM = 2, 5, 2, 0.5, 1.0


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """One session: the planted Trainer cases at world sizes 1 and 2, each rank of the recorded one
    writing its micro-batches and weights."""
    folder = tmp_path_factory.mktemp("trainer-run")
    progress = folder / "progress"
    progress.mkdir()
    process, token = start_pytest([TRAINER_CASES, "--world-sizes", "1,2"], folder / "reports",
                                  PLANTED_PROGRESS_DIR=str(progress))
    with killed_if_failing(process):
        stdout, stderr = process.communicate(timeout=600)
    session = Session(process.returncode, stdout, stderr, folder / "reports", token, 0.0)
    return session, folder / "progress"


def windows(batches_per_rank: list[list[dict]]) -> list[list[dict]]:
    """The specification's global batches: per epoch, each rank's batches in windows of STEPS (the
    last shorter), the same window of every rank together."""
    out = []
    for epoch in range(EPOCHS):
        for start in range(0, BATCHES, STEPS):
            out.append([b for rank in batches_per_rank
                        for b in rank[epoch * BATCHES + start: epoch * BATCHES + min(start + STEPS, BATCHES)]])
    return out


def float64_training(initial: dict, global_batches: list[list[dict]], *, mean_of_means: bool = False) -> dict:
    """SGD on a float64 copy of the model, each step from the gradient of the mean token loss over
    its whole global batch (``mean_of_means``: instead each micro-batch's own token mean, averaged,
    the normalisation before transformers 4.46), clipped at MAX_NORM, at the linear schedule's rate."""
    model = causal_lm()
    model.load_state_dict(initial)
    model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    for step, batches in enumerate(global_batches):
        sums, counts = [], []
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            sums.append(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                          targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                                          reduction="sum"))
            counts.append(int(targets.ne(IGNORE_INDEX).sum()))
        loss = (sum(s / c for s, c in zip(sums, counts)) / len(sums) if mean_of_means
                else sum(sums) / sum(counts))
        grads = torch.autograd.grad(loss, params)
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        coefficient = min(1.0, MAX_NORM / (norm + 1e-6))
        rate = LR * (len(global_batches) - step) / len(global_batches)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= rate * coefficient * g
    return {k: v for k, v in model.state_dict().items()}


def test_the_trainer_expectation_is_the_float64_full_batch_training_over_every_ranks_micro_batches(trainer_run):
    session, progress = trainer_run
    cells = session.cells()
    assert cells[("planted_trainer_recorded", "fp32", 2)]["status"] == "pass", session.stdout[-3000:]
    dumps = [torch.load(progress / f"trainer-ws2-rank{rank}.pt") for rank in (0, 1)]
    assert [len(d["batches"]) for d in dumps] == [EPOCHS * BATCHES] * 2
    # the ranks ran different micro-batches, with different numbers of targets: the weighting matters
    assert dumps[0]["batches"][0]["labels"].ne(IGNORE_INDEX).sum() != dumps[1]["batches"][0]["labels"].ne(
        IGNORE_INDEX).sum() or dumps[0]["batches"][1]["labels"].shape != dumps[1]["batches"][1]["labels"].shape
    expected = float64_training(dumps[0]["initial"], windows([d["batches"] for d in dumps]))
    wrong = float64_training(dumps[0]["initial"], windows([d["batches"] for d in dumps]), mean_of_means=True)
    for name, value in expected.items():
        final = dumps[0]["final"][name].double()
        assert torch.equal(dumps[1]["final"][name], dumps[0]["final"][name]), name
        # fp32 training against float64 over 6 steps: ~1e-6 apart; the other normalisation moves
        # the weights by more than 1e-3, which this bound tells apart
        torch.testing.assert_close(final, value, rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    assert max(float((expected[k] - wrong[k]).abs().max()) for k in expected) > 1e-3


def test_a_compute_loss_that_divides_by_the_steps_again_is_wrong_scale_and_says_so(trainer_run):
    session, _ = trainer_run
    cells = session.cells()
    for ws in (1, 2):
        cell = cells[("planted_trainer_divides_again", "fp32", ws)]
        assert cell["status"] == "detected", cell["summary"]
        norms = [f for f in cell["failures"] if f["checked"] == "grad_norm"]
        assert norms and {f["kind"] for f in norms} == {"wrong_scale"}
        # the shorter last window of an epoch (one micro-batch) is divided by 2 all the same
        assert {round(f["factor"], 6) for f in norms} == {0.5}
        assert "grad_norm logged by Trainer on rank 0 at step 2 (epoch 0, batch 1): is" in norms[0]["message"]
        assert "(0.5 times it)" in norms[0]["message"]


def test_the_catalogue_trainer_cells_pass_detect_their_canary_and_their_live_defect(run_pytest):
    session = run_pytest("cases/test_trainer.py", "-k", "2-average or 2-fp32 or 2-bf16", "--world-sizes", "1,2")
    cells = session.cells()
    skipped = {key: cell for key, cell in cells.items()
               if "wrapper=fsdp2" in key[1] or "wrapper=deepspeed" in key[1] and "-bf16" in key[1]}
    # FSDP2, and bf16 under DeepSpeed: no Trainer runs them on a CPU host; each cell says why
    assert skipped and {cell["status"] for cell in skipped.values()} == {"skip"}
    assert all("Trainer" in cell["summary"] or "world size 2" in cell["summary"] for cell in skipped.values())
    # Trainer's own DeepSpeed at ZeRO-1, 2 and 3: each as under DDP, the sample-weighed classifier's
    # #47688 named misweighted there (its gradient is read before DeepSpeed's clip)
    assert {(c, v, ws): cell["status"] for (c, v, ws), cell in cells.items()
            if "wrapper=deepspeed" in v and "-fp32" in v} == {
        (case, f"{lead}-fp32-wrapper=deepspeed-z{stage}", ws): status
        for case, lead, status in (("trainer_causal_lm", "steps=2-average_tokens=true", "pass"),
                                   ("trainer_classifier", "steps=2", "detected"),
                                   ("trainer_classifier_plain_mean", "steps=2", "pass"))
        for stage in (1, 2, 3) for ws in (1, 2)}, session.stdout[-3000:]
    for stage in (1, 2, 3):
        classifier = cells[("trainer_classifier", f"steps=2-fp32-wrapper=deepspeed-z{stage}", 2)]
        assert {f["kind"] for f in classifier["failures"]} == {"misweighted"}, classifier["summary"]
    statuses = {(c, v, ws): cell["status"] for (c, v, ws), cell in cells.items() if "wrapper=" not in v}
    # each the same in bf16 (Trainer's bf16=True, accelerate's autocast, which the oracle's replica runs too)
    assert statuses == {(case, f"{variant}-{precision}", ws): status
                        for (case, variant, ws), status in {
                            ("trainer_causal_lm", "steps=2-average_tokens=true", 1): "pass",
                            ("trainer_causal_lm", "steps=2-average_tokens=true", 2): "pass",
                            ("trainer_causal_lm", "steps=2-average_tokens=false", 1): "skip",
                            ("trainer_causal_lm", "steps=2-average_tokens=false", 2): "detected",
                            ("trainer_classifier", "steps=2", 1): "detected",
                            ("trainer_classifier", "steps=2", 2): "detected",
                            ("trainer_classifier_plain_mean", "steps=2", 1): "pass",
                            ("trainer_classifier_plain_mean", "steps=2", 2): "pass",
                            # transformers #48690 and the router loss summed over the window, declared (mismatch)
                            ("trainer_moe_router_loss", "steps=2", 1): "detected",
                            ("trainer_moe_router_loss", "steps=2", 2): "detected",
                        }.items() for precision in ("fp32", "bf16")}, session.stdout[-3000:]
    bf16 = cells[("trainer_causal_lm", "steps=2-average_tokens=true-bf16", 2)]
    assert bf16["grad_checks"] > 0 and bf16["vacuous_checks"] == 0, bf16["summary"]


def test_the_live_bug_cases_catch_their_bug_with_its_factor_and_pass_with_its_remedy(run_pytest):
    """transformers #35856 (a compute_loss override's mean never divided by the window), #38837 in a
    subclass (the short last window divided by the configured steps), #39392 (the default token
    averaging, right from 4.54), pytorch #154888 (FSDP1 HYBRID_SHARD on nodes of one device) and trl
    #5619 (a generation batch's token count for each of its windows)."""
    session = run_pytest("cases/test_trainer.py", "cases/test_fsdp1_hybrid_shard.py", "cases/test_token_loss.py", "-k",
                         "compute_loss or default_token or (hybrid and fp32) or generation_batch", "--wrappers", "ddp,fsdp1",
                         "--world-sizes", "2")
    cells = {(case, variant): cell for (case, variant, _), cell in session.cells().items()
             if case.startswith("trainer_") and "steps=2" in variant
             or case == "fsdp1_hybrid_shard" and "steps=1" in variant
             or case == "accumulate_token_generation_batch" and variant.endswith("fp32")}
    assert {key: cell["status"] for key, cell in cells.items()} == {
        ("trainer_compute_loss_mean", "steps=2"): "detected",
        ("trainer_compute_loss_remedied", "remedy=loss_is_scaled_for_ga-steps=2"): "pass",
        ("trainer_compute_loss_remedied", "remedy=model_accepts_loss_kwargs-steps=2"): "pass",
        ("trainer_compute_loss_own_scale", "divisor=configured_steps-steps=2"): "detected",
        ("trainer_compute_loss_own_scale", "divisor=current_steps-steps=2"): "pass",
        ("trainer_default_token_averaging", "steps=2"): "pass",
        ("fsdp1_hybrid_shard", "steps=1-fp32-wrapper=fsdp1"): "detected",
        ("accumulate_token_generation_batch", "normaliser=window-fp32"): "pass",
        ("accumulate_token_generation_batch", "normaliser=generation_batch-fp32"): "detected",
    }, session.stdout[-3000:]

    def logged_norm_factors(key):
        return {round(f["factor"], 6) for f in cells[key]["failures"] if f["checked"] == "grad_norm"}

    # every window of two micro-batches twice its mean (the epoch's last window, of one, is right)
    assert logged_norm_factors(("trainer_compute_loss_mean", "steps=2")) == {2.0}
    # only the epoch's last window, of one micro-batch, divided by 2
    assert logged_norm_factors(("trainer_compute_loss_own_scale", "divisor=configured_steps-steps=2")) == {0.5}
    failing = {f["step"] for f in cells[("trainer_compute_loss_own_scale", "divisor=configured_steps-steps=2")]["failures"]}
    assert min(failing) == 5  # epoch 0's windows: micro-steps 1-2, 3-4 and 5 alone
    for key, cell in cells.items():
        if cell["status"] == "pass":
            assert cell["grad_checks"] > 0 and cell["vacuous_checks"] == 0, (key, cell["summary"])
    # each rank's gradient its own: its micro-batch weighs 1, every other rank's 0, from the first step
    hybrid = cells[("fsdp1_hybrid_shard", "steps=1-fp32-wrapper=fsdp1")]
    assert min(f["step"] for f in hybrid["failures"]) == 1 and {0, 1} <= {f["rank"] for f in hybrid["failures"]}
    assert "weights by rank: 1, 0" in hybrid["failures"][0]["message"]
    # TRL GRPO's count of a generation batch of two windows (trl #5619): each window's tokens weigh
    # about half their share, from the first micro-batch on every rank
    generation = cells[("accumulate_token_generation_batch", "normaliser=generation_batch-fp32")]
    assert {f["kind"] for f in generation["failures"] if f["step"] == 1} == {"misweighted"}


def test_a_bf16_trainer_cell_catches_a_forward_run_without_autocast():
    """The planted fault autocast_dropped (accelerate's mixed-precision forward without autocast: bf16
    asked, fp32 computed) on the Trainer's bf16 cell: clean it passes, planted it fails as mismatch,
    the kind the fault declares. The bf16 cells check bf16 training, not an fp32 run called bf16."""
    from harness.catalogue import load_case_file
    from harness.records import Status
    from harness.selfcheck import run as selfcheck
    from harness.selfcheck.run import Runner, Target, first_kinds
    from harness.wrappers.registry import WRAPPERS
    from harness.wrappers.prepare import cell_variants

    case = next(c for c in load_case_file(ROOT / "cases" / "test_trainer.py") if c.name == "trainer_causal_lm")
    variant = next(v for v in cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
                   if v.name == "steps=2-average_tokens=true-bf16")
    with Runner(world_size=2) as runner:
        clean, faulty = runner.run(Target(case, variant)), runner.run(Target(case, variant), fault="autocast_dropped")
    assert clean.status == Status.PASS, f"{clean.summary}\n{clean.detail}"
    assert faulty.status == Status.FAIL and "mismatch" in first_kinds(faulty), faulty.summary
    assert selfcheck.names(faulty, selfcheck.FAULTS["autocast_dropped"])


def test_a_deepspeed_trainer_cell_catches_the_loss_divided_by_the_steps_again():
    """Trainer under DeepSpeed (its own TrainingArguments(deepspeed=...)) at ZeRO-2: clean it passes;
    with the planted deepspeed_scale_wrt_gas_dropped (Trainer's scale_wrt_gas=False lost on the way to
    the engine, transformers before PR #35808) the engine divides each window's loss by the steps again
    and the cell fails, misweighted, a kind the fault declares."""
    from harness.catalogue import load_case_file
    from harness.records import Status
    from harness.selfcheck import run as selfcheck
    from harness.selfcheck.run import Runner, Target, first_kinds
    from harness.wrappers.registry import WRAPPERS
    from harness.wrappers.prepare import cell_variants

    case = next(c for c in load_case_file(ROOT / "cases" / "test_trainer.py") if c.name == "trainer_causal_lm")
    variant = next(v for v in cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
                   if v.name == "steps=2-average_tokens=true-fp32-wrapper=deepspeed-z2")
    # windows of 3 and 2: three micro-batches a window, summed by ZeRO-2 after each reduction, of token
    # weights that round two ways (each sum of them allowed its rounding, harness/rank/oracle/core.py)
    threes = next(v for v in cell_variants(case.info.variants, case.info.wrappers, WRAPPERS)
                  if v.name == "steps=3-average_tokens=true-fp32-wrapper=deepspeed-z2")
    with Runner(world_size=2) as runner:
        clean = runner.run(Target(case, variant))
        faulty = runner.run(Target(case, variant), fault="deepspeed_scale_wrt_gas_dropped")
        three = runner.run(Target(case, threes))
    assert clean.status == Status.PASS, f"{clean.summary}\n{clean.detail}"
    assert faulty.status == Status.FAIL and "misweighted" in first_kinds(faulty), faulty.summary
    assert selfcheck.names(faulty, selfcheck.FAULTS["deepspeed_scale_wrt_gas_dropped"])
    assert three.status == Status.PASS, f"{three.summary}\n{three.detail}"
