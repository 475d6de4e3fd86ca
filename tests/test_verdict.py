"""Every way the ranks' results become a cell: no outcome is judged pass unless every rank ran,
agreed, compared gradients and (from two ranks on) could tell synced from local."""

from __future__ import annotations

import dataclasses

import pytest

from harness.controller.verdict import judge
from harness.decorator import Diagnosis
from harness.decorator import GLOO_AVG_SUMS, probed
from harness.messages import CellOutcome, RankResult
from harness.records import Failure, FaultKind, RankFault, RankOutcome
from harness.wording import cell_message as format_message

NESTED = (Diagnosis("not_synced", model="gen"), Diagnosis("stepped_early", model="disc"))


def failure(kind, model="model", rank=1, step=2, checked="grad"):
    return Failure(rank=rank, step=step, model=model, param="weight", kind=kind, max_abs_diff=0.5,
                   checked=checked, message=f"'{model}.weight' on rank {rank} at step {step}: {kind}")


def result(rank, *, outcome=RankOutcome.OK, failures=(), checks=12, grad_checks=6, vacuous=0, detail=""):
    return RankResult(rank=rank, outcome=outcome, detail=detail, failures=list(failures), checks=checks,
                      grad_checks=grad_checks, vacuous_checks=vacuous, max_abs_diff=2.5e-7)


def cell(*results, world_size=2, detects=(), **kwargs):
    outcome = CellOutcome(results={r.rank: r for r in results})
    options = dict(case="c", variant="fp32", world_size=world_size, detects=detects, outcome=outcome,
                   timeout_s=10.0, duration_s=0.1, rerun="pytest 'cases/c.py::test_c[fp32-ws2]'")
    options.update(kwargs)
    return judge(**options)


def test_every_rank_matching_with_sync_tested_is_pass_and_says_what_was_compared():
    c = cell(result(0), result(1))
    assert c.status == "pass"
    assert (c.checks, c.grad_checks, c.vacuous_checks) == (24, 12, 0)
    assert c.summary == "24 checks on 2 ranks, 12 of them gradients; max |diff| 2.5e-07"


def test_world_size_one_passes_and_says_its_checks_are_vacuous_for_sync():
    c = cell(result(0, vacuous=6), world_size=1)
    assert c.status == "pass"
    assert "all vacuous for sync (world size 1 cannot tell synced from local)" in c.summary


def test_from_two_ranks_on_only_vacuous_gradient_checks_are_an_error_not_a_pass():
    c = cell(result(0, vacuous=6), result(1, vacuous=6))
    assert c.status == "error"
    assert "too alike to tell a synced gradient from a local one (a harness defect)" in c.summary


def test_some_vacuous_checks_are_counted_not_fatal():
    c = cell(result(0, vacuous=2), result(1, vacuous=2))
    assert c.status == "pass" and "4 vacuous for sync" in c.summary


def test_a_cell_that_compared_no_gradient_is_an_error_and_a_canary_that_did_is_missed():
    assert cell(result(0, checks=4, grad_checks=0), result(1, checks=4, grad_checks=0)).status == "error"
    canary = cell(result(0, checks=0, grad_checks=0), result(1, checks=0, grad_checks=0), detects=NESTED)
    assert canary.status == "missed"


def test_a_failure_on_any_rank_fails_the_cell_and_the_message_reads_like_assert_close():
    c = cell(result(0), result(1, failures=[failure("not_synced"), failure("params_diverged", checked="param")]))
    assert c.status == "fail"
    assert c.summary.startswith("2 mismatches on rank 1: not_synced in model; params_diverged in model")
    message = format_message(c)
    assert message.splitlines()[0] == "Gradients are not right on every rank: c[fp32] at world size 2"
    assert "Diagnoses: not_synced x1, params_diverged x1" in message
    assert message.splitlines()[-1] == "Rerun this cell: pytest 'cases/c.py::test_c[fp32-ws2]'"


@pytest.mark.parametrize("other", [RankOutcome.SKIPPED, RankOutcome.UNSUPPORTED])
def test_ranks_that_disagree_on_skip_or_unsupported_make_an_error_that_keeps_the_failures_visible(other):
    c = cell(result(0, outcome=other, detail="not here"), result(1, failures=[failure("wrong_scale")]))
    assert c.status == "error"
    assert "the ranks disagree on whether the cell applies" in c.summary
    assert "rank 0" in c.summary and "rank 1 ran it (" not in c.summary
    assert "rank 1 ran it with 1 failures" in c.summary


def test_ranks_that_agree_on_skip_or_unsupported_give_that_status_with_the_reason():
    skipped = cell(result(0, outcome=RankOutcome.SKIPPED, detail="needs 4 GPUs"), result(1, outcome=RankOutcome.SKIPPED, detail="needs 4 GPUs"))
    assert (skipped.status, skipped.summary) == ("skip", "needs 4 GPUs")
    lacking = cell(result(0, outcome=RankOutcome.UNSUPPORTED, detail="installed accelerate lacks X"),
                   result(1, outcome=RankOutcome.UNSUPPORTED, detail="installed accelerate lacks X"))
    assert (lacking.status, lacking.summary) == ("unsupported", "installed accelerate lacks X")


def test_a_canary_is_detected_only_by_the_diagnoses_it_declares():
    found = [failure("not_synced", model="gen"), failure("stepped_early", model="disc", checked="param")]
    c = cell(result(0, failures=found), result(1), detects=NESTED)
    assert c.status == "detected"
    assert c.summary.startswith("diagnosed as declared (not_synced in gen, stepped_early in disc): ")


def test_a_canary_caught_by_another_kind_alone_is_missed():
    """The nested canary caught by the sync flag alone proves nothing of the gradient checks."""
    c = cell(result(0, failures=[failure("sync_flag", model="accelerator", checked="flag")]), result(1),
             detects=NESTED)
    assert c.status == "missed"
    assert "no not_synced in gen, stepped_early in disc" in c.summary
    assert format_message(c).startswith("The harness missed a known-wrong pattern: c[fp32] at world size 2")


def test_a_canary_with_the_right_kind_in_the_wrong_model_is_missed():
    c = cell(result(0, failures=[failure("not_synced", model="disc"), failure("stepped_early", model="disc")]),
             result(1), detects=NESTED)
    assert c.status == "missed" and "no not_synced in gen" in c.summary


def test_a_canary_with_no_failure_at_all_is_missed():
    assert cell(result(0), result(1), detects=NESTED).status == "missed"


def test_at_world_size_one_a_canary_needs_only_what_one_rank_can_show():
    c = cell(result(0, failures=[failure("stepped_early", model="disc", checked="param")], vacuous=6),
             world_size=1, detects=NESTED)
    assert c.status == "detected"
    only_sync = cell(result(0, vacuous=6), world_size=1, detects=(Diagnosis("not_synced"),))
    assert only_sync.status == "skip" and "world size 1 cannot show" in only_sync.summary


def test_a_rank_that_raised_names_it_and_the_blocked_ones():
    outcome = CellOutcome(faults=[RankFault(1, FaultKind.RAISED, "Traceback ...\nZeroDivisionError: planted"),
                                  RankFault(0, FaultKind.BLOCKED, "File distributed_c10d.py in all_reduce")])
    c = judge(case="c", variant="v", world_size=2, outcome=outcome, timeout_s=5, duration_s=1)
    assert c.status == "error"
    assert c.summary == "rank 1 raised ZeroDivisionError: planted (rank 0 blocked waiting for it)"
    assert "--- rank 1 raised ZeroDivisionError: planted ---" in c.detail


def test_what_the_ranks_judged_before_one_raised_is_kept_in_the_error_cell():
    # a training script that synced its first micro-batch early and then crashed in its optimizer step
    early = failure("synced_early", rank=0, step=1)
    outcome = CellOutcome(results={0: result(0, outcome=RankOutcome.RAISED, failures=[early],
                                             detail="Traceback ...\nAssertionError: capturable")},
                          faults=[RankFault(0, FaultKind.RAISED, "Traceback ...\nAssertionError: capturable")])
    c = judge(case="c", variant="v", world_size=1, outcome=outcome, timeout_s=5, duration_s=1)
    assert c.status == "error" and c.failures == [early]
    assert c.summary == ("rank 0 raised AssertionError: capturable; before it, 1 mismatch on rank 0: synced_early in "
                         "model; first: model.weight on rank 0 at step 1")
    # and a rank that raised with nothing judged before is said as before
    clean = CellOutcome(results={0: result(0, outcome=RankOutcome.RAISED, detail="Traceback ...\nValueError: x")},
                        faults=[RankFault(0, FaultKind.RAISED, "Traceback ...\nValueError: x")])
    assert judge(case="c", variant="v", world_size=1, outcome=clean, timeout_s=5, duration_s=1).summary == \
        "rank 0 raised ValueError: x"


@pytest.mark.parametrize("what, detail, summary", [
    (FaultKind.EXITED, "exited with code 7\nlog", "rank 1 exited with code 7"),
    (FaultKind.KILLED, "killed by SIGKILL", "rank 1 killed by SIGKILL"),
    (FaultKind.HUNG, "", "rank 1 hung (no result within 5 s)"),
])
def test_a_rank_that_died_or_hung_is_named(what, detail, summary):
    c = judge(case="c", variant="v", world_size=2, outcome=CellOutcome(faults=[RankFault(1, what, detail)]),
              timeout_s=5, duration_s=1)
    assert (c.status, c.summary) == ("error", summary)


def test_a_pool_that_did_not_start_and_a_controller_that_failed_are_errors():
    c = judge(case="c", variant="v", world_size=2, outcome=None, timeout_s=5, duration_s=0,
              start_error="rank 1 of 2 failed to start:\nRuntimeError: no gloo")
    assert c.status == "error" and c.summary == "the pool of 2 ranks did not start: RuntimeError: no gloo"
    c = judge(case="c", variant="v", world_size=2, outcome=None, timeout_s=5, duration_s=0,
              controller_error="Traceback (most recent call last):\nOSError: [Errno 9] Bad file descriptor")
    assert c.status == "error"
    assert c.summary == "the harness failed while waiting for the cell: OSError: [Errno 9] Bad file descriptor"
    assert format_message(c).startswith("The cell could not be judged: c[v] at world size 2")


def test_a_declared_raise_before_any_check_is_detected_and_an_undeclared_cell_without_checks_still_an_error():
    raised = Diagnosis("raised", match="expect_autograd_hooks_", ranks=2)
    raising = [result(r, checks=0, grad_checks=0, failures=[failure("raised", model="", rank=r, step=1,
                                                                     checked="raise")]) for r in (0, 1)]
    c = cell(*raising, detects=(raised,))
    assert c.status == "detected", c.summary
    # a canary of another kind that raised nothing and checked nothing is still missed
    assert cell(result(0, checks=0, grad_checks=0), result(1, checks=0, grad_checks=0),
                detects=(raised,)).status == "missed"


def defective(rank, **kwargs):
    """A rank's result from a cell whose syncs went through gloo's AVG reduce-scatter that sums."""
    return dataclasses.replace(result(rank, **kwargs), defects=[GLOO_AVG_SUMS])


@pytest.mark.parametrize("kind", ["wrong_scale", "misweighted"])
def test_a_cell_through_a_probed_backend_defect_is_detected_naming_it(kind):
    """The defect scales the gradient by the world size: ``wrong_scale``, or in a window weighed by
    tokens ``misweighted``; either is the declared diagnosis, and the summary names the report and fix."""
    c = cell(defective(0, failures=[failure(kind)]), defective(1, failures=[failure(kind, rank=1)]))
    assert c.status == "detected", c.summary
    assert c.summary.startswith("diagnosed as declared (wrong_scale or misweighted (pytorch/pytorch#162338: "
                                "gloo's AVG reduce-scatter sums, fixed in torch 2.9.0)): ")


def test_a_cell_through_a_probed_backend_defect_that_shows_nothing_is_missed_and_without_it_a_fail_stays_a_fail():
    assert cell(defective(0), defective(1)).status == "missed"
    assert cell(defective(0, failures=[failure("stale")]), defective(1)).status == "missed"
    # no rank went through it: the same failure is an ordinary fail, named by nothing declared
    plain = cell(result(0, failures=[failure("wrong_scale")]), result(1))
    assert plain.status == "fail" and "162338" not in plain.summary


def test_a_canary_through_a_probed_backend_defect_must_show_its_own_diagnoses_too():
    own = (Diagnosis("not_synced", model="gen"),)
    both = cell(defective(0, failures=[failure("not_synced", model="gen"), failure("wrong_scale")]), defective(1),
                detects=own)
    assert both.status == "detected" and "not_synced in gen, wrong_scale or misweighted" in both.summary
    assert cell(defective(0, failures=[failure("wrong_scale")]), defective(1), detects=own).status == "missed"


def test_a_probed_defect_this_harness_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown probed defect 'gloo_sums_twice'"):
        probed(["gloo_sums_twice"])
