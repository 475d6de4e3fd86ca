"""Option parsing and what auto resolves to. GPU counts other than this machine's are passed in
(``gpu_count=``): the one thing these tests cannot have for real."""

import pytest

from harness.controller.options import OptionError, parse_world_sizes, resolve

DEFAULTS = dict(world_sizes="auto", backend="auto", report_dir="reports", case_timeout="120", seed="1234")


def settings(**overrides):
    return resolve(**{**DEFAULTS, **overrides})


def test_world_sizes_are_sorted_and_deduplicated():
    assert parse_world_sizes("4,1,2,2") == (1, 2, 4)
    assert parse_world_sizes(" 3 ") == (3,)
    assert parse_world_sizes("auto") is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"world_sizes": "0"}, "--world-sizes: '0' is not a positive integer"),
        ({"world_sizes": "two"}, "--world-sizes: 'two' is not a positive integer"),
        ({"world_sizes": "1,,2"}, "--world-sizes: '' is not a positive integer"),
        ({"world_sizes": "-2"}, "--world-sizes: '-2' is not a positive integer"),
        ({"backend": "mpi"}, "--backend: 'mpi' is not one of auto, gloo, nccl"),
        ({"case_timeout": "0"}, "--case-timeout: '0' must be a positive number of seconds"),
        ({"case_timeout": "inf"}, "--case-timeout: 'inf' must be a positive number of seconds"),
        ({"case_timeout": "soon"}, "--case-timeout: 'soon' is not a number of seconds"),
        ({"case_timeout": "3e6"}, "--case-timeout: '3e6' is longer than this platform can wait"),
        ({"seed": "1.5"}, "--seed: '1.5' is not an integer"),
        ({"seed": "-1"}, "--seed: '-1' must be zero or positive"),
    ],
)
def test_bad_values_name_the_option_in_one_line(overrides, message):
    with pytest.raises(OptionError) as info:
        settings(gpu_count=0, **overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_auto_on_cpu_is_gloo_at_1_2_4():
    s = settings(gpu_count=0)
    assert (s.backend, s.device, s.world_sizes) == ("gloo", "cpu", (1, 2, 4))


@pytest.mark.parametrize("gpus, sizes", [(1, (1,)), (2, (1, 2)), (3, (1, 2)), (8, (1, 2, 4, 8))])
def test_auto_with_gpus_is_nccl_at_powers_of_two_up_to_the_gpu_count(gpus, sizes):
    s = settings(gpu_count=gpus)
    assert (s.backend, s.device, s.world_sizes) == ("nccl", "cuda", sizes)


def test_auto_backend_falls_back_to_gloo_when_some_rank_would_have_no_gpu():
    assert settings(world_sizes="1,2,4", gpu_count=2).backend == "gloo"
    assert settings(world_sizes="1,2", gpu_count=2).backend == "nccl"


def test_explicit_nccl_is_kept_even_without_gpus_so_that_cells_can_say_why_they_skip():
    s = settings(backend="nccl", world_sizes="1,2", gpu_count=0)
    assert (s.backend, s.world_sizes, s.gpu_count) == ("nccl", (1, 2), 0)


def test_the_longest_case_timeout_accepted_is_one_the_pool_can_really_wait_for():
    import multiprocessing
    from multiprocessing.connection import wait

    from harness.controller.options import MAX_CASE_TIMEOUT_S

    assert settings(gpu_count=0, case_timeout=str(MAX_CASE_TIMEOUT_S)).case_timeout_s == MAX_CASE_TIMEOUT_S
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.send(1)
    assert wait([reader], MAX_CASE_TIMEOUT_S) == [reader]  # ready at once, but the timeout is accepted
    with pytest.raises(OverflowError):
        wait([reader], MAX_CASE_TIMEOUT_S + 1)


def test_the_rerun_command_writes_its_reports_beside_the_runs_not_over_them():
    from harness.controller.cells import rerun_command

    command = rerun_command("cases/test_x.py::test_x[fp32-ws2]", world_size=2, backend="gloo", seed=7,
                            report_dir="out", case_timeout_s=30, fault="grads_summed")
    assert command == ("pytest 'cases/test_x.py::test_x[fp32-ws2]' --world-sizes 2 --backend gloo --seed 7 "
                       "--report-dir out/rerun --case-timeout 30 --harness-fault grads_summed")
