"""fp8 (torchao) with FSDP2 and float8 all-gather on 2 real processes over gloo (checks in checks_fp8_fsdp.py).

CPU float8 is slow (~12x fp32), so the layers are tiny (32 wide).
"""

import pytest

from distributed import check_names, run_checks

pytest.importorskip("torchao")


@pytest.fixture(scope="module")
def two_ranks():
    return run_checks("checks_fp8_fsdp", world_size=2)


@pytest.mark.parametrize("name", check_names("checks_fp8_fsdp"))
def test_fp8_fsdp(two_ranks, name):
    two_ranks.assert_passed(name)


def test_fp8_with_fsdp_and_tensor_parallel_is_refused():
    report = run_checks("checks_fp8_fsdp", world_size=4, only=["four_ranks_fp8_with_tensor_parallel_is_refused"])
    for message in report.assert_passed("four_ranks_fp8_with_tensor_parallel_is_refused"):
        assert "tp_size > 1" in message and "fp8 with FSDP2 alone" in message
