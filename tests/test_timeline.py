"""Tests for harness.timeline: what each rank records of its checks, the joined timeline a cell
keeps in matrix.json (real ranks, a real planted fault), and the file's checks of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.catalogue import load_case_file
from harness.matrix.file import parse_matrix
from harness.matrix.schema import Cell, Matrix, MatrixError
from harness.rank.judging.recorder import Recorder
from harness.rank.oracle.schedule import MicroStep
from harness.records import Failure
from harness.render.reports import render_json
from harness.selfcheck.run import Runner, Target
from harness.timeline import Timeline, TimelineRecorder

ROOT = Path(__file__).resolve().parent.parent


def failure(step: int, kind: str, checked: str = "grad", rank: int = 1) -> Failure:
    return Failure(rank=rank, step=step, model="model", param="w", kind=kind, max_abs_diff=1.0, message="m",
                   checked=checked)


def test_a_mark_keeps_the_first_diagnosis_and_an_agreeing_check_does_not_hide_a_failure():
    recorder = Recorder(rank=1)
    recorder.timeline.mark(3, "grad")  # model a agreed
    recorder.add(failure(3, "not_synced"))  # model b did not
    recorder.timeline.mark(3, "grad")  # model c agreed
    recorder.add(failure(3, "mismatch"))
    recorder.timeline.mark(4, "grad")
    assert recorder.timeline.marks == {(3, "grad"): "not_synced", (4, "grad"): ""}


def test_marks_are_never_cut_short_as_the_failures_are():
    recorder = Recorder(rank=0)
    for step in range(1, 201):
        recorder.add(failure(step, "stale", rank=0))
    assert len(recorder.failures) < 200 and recorder.omitted
    assert len(recorder.timeline.marks) == 200


def test_the_ranks_join_into_one_timeline_in_step_rank_and_check_order():
    zero, one = TimelineRecorder(rank=0), TimelineRecorder(rank=1)
    for recorder in (one, zero):
        recorder.at(2, epoch=0, batch=1, sync=True, optimizer_step=True)
        recorder.mark(2, "param")
        recorder.mark(2, "grad", "not_synced" if recorder.rank else None)
        recorder.mark(1, "flag")
    one.at(1, sync=False)
    timeline = Timeline.join([one, zero])
    assert [(s.step, s.sync, s.optimizer_step) for s in timeline.steps] == [(1, False, None), (2, True, True)]
    assert [(m.step, m.rank, m.check, m.kind) for m in timeline.marks] == [
        (1, 0, "flag", None), (1, 1, "flag", None),
        (2, 0, "grad", None), (2, 0, "param", None), (2, 1, "grad", "not_synced"), (2, 1, "param", None),
    ]
    assert timeline.ranks == [0, 1]
    assert Timeline.from_dict(json.loads(json.dumps(timeline.to_dict()))) == timeline


def test_a_cell_writes_its_timeline_only_when_it_has_one():
    plain = Cell("c", "v", 2, "pass")
    assert "timeline" not in plain.to_dict()
    timeline = Timeline.join([TimelineRecorder(rank=0, marks={(1, "grad"): "stale"})])
    failing = Cell("c", "w", 2, "fail", timeline=timeline)
    read = parse_matrix(json.loads(render_json(Matrix(environment={}, cells=[plain, failing]))))
    assert read.cells[0].timeline is None and read.cells[1].timeline == timeline


@pytest.mark.parametrize("timeline, problem", [
    ([], "timeline is an empty list, expected an object (a timeline) or null"),
    ({"steps": {}}, "timeline.steps is an empty object, expected a list of timeline steps"),
    ({"steps": [{"epoch": 0}]}, "timeline.steps[0].step is missing"),
    ({"steps": [{"step": 1, "sync": "yes"}]}, "timeline.steps[0].sync is the string 'yes', expected true or false or null"),
    ({"marks": [{"rank": 0, "step": 1, "check": "grad", "kind": 3}]},
     "timeline.marks[0].kind is 3, expected a string or null"),
    ({"marks": [7]}, "timeline.marks[0] is 7, expected an object (a timeline mark)"),
])
def test_a_malformed_timeline_is_refused_in_one_line_naming_the_field(timeline, problem):
    data = {"schema_version": 1, "cells": [{"case": "c", "variant": "v", "world_size": 2, "status": "fail",
                                            "timeline": timeline}]}
    with pytest.raises(MatrixError) as raised:
        parse_matrix(data)
    assert str(raised.value) == f"matrix: cells[0] (c / v / ws=2): {problem}"


def test_a_microstep_gives_the_whole_schedule_point():
    recorder = Recorder(rank=0)
    from harness.rank.judging.recorder import mark_point

    mark_point(recorder, MicroStep(index=5, epoch=1, batch=0, sync=False, optimizer_step=False, end_of_dataloader=False))
    mark_point(recorder, 6, sync=True)
    mark_point(recorder, 6, optimizer_step=True)
    steps = recorder.timeline.steps
    assert (steps[5].epoch, steps[5].batch, steps[5].sync, steps[5].optimizer_step) == (1, 0, False, False)
    assert (steps[6].epoch, steps[6].sync, steps[6].optimizer_step) == (None, True, True)


def test_a_real_cell_with_one_bad_rank_draws_that_rank_failing_at_every_step_and_the_other_agreeing(monkeypatch):
    # accumulate at 2 steps on 2 gloo ranks, rank 1's gradients scaled by 1+1e-3 after every backward
    monkeypatch.chdir(ROOT)
    case = next(c for c in load_case_file(ROOT / "cases" / "test_accumulate.py") if c.name == "accumulate")
    variant = next(v for v in case.info.variants if v.name == "steps=2-fp32")
    with Runner(world_size=2) as runner:
        clean = runner.run(Target(case, variant))
        faulty = runner.run(Target(case, variant), fault="rank_grad_perturbed")
    assert clean.status == "pass" and clean.timeline is None
    assert faulty.status == "fail" and faulty.timeline is not None
    timeline = faulty.timeline
    assert timeline.ranks == [0, 1]
    steps = {s.step: s for s in timeline.steps}
    windows = [(s.step, s.sync, s.optimizer_step) for s in timeline.steps if s.step > 0]
    assert windows[:4] == [(1, False, False), (2, True, True), (3, False, False), (4, True, True)]
    assert all(steps[s].epoch is not None and steps[s].batch is not None for s in steps if s > 0)
    grads = {(m.rank, m.step): m.kind for m in timeline.marks if m.check == "grad"}
    assert {k for (rank, _), k in grads.items() if rank == 0} == {None}
    assert all(grads[(1, step)] for step in steps if step > 0)
    # every failure has its mark, of its kind where it was the first one there
    for f in faulty.failures:
        assert any(m.rank == f.rank and m.step == f.step and m.check == f.checked and m.kind for m in timeline.marks)
    assert {m.check for m in timeline.marks} >= {"flag", "grad", "param", "comm", "schedule"}
