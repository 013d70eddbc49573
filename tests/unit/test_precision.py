"""Which precisions and table dtypes the strategy trains with, and the refusals of the others
(each names the user's flag or table and why); the parity under bf16-mixed and with FP16 tables
is tests/ranks/test_precision_fit.py."""

import pytest
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_sparselift.lightning.trainer_support import check_precision
from lightning_sparselift.sharding import TableInfo, check_data_types, validate_sharding_types


@pytest.mark.parametrize("plugin", [Precision(), MixedPrecision("bf16-mixed", "cpu")], ids=["32-true", "bf16-mixed"])
def test_full_and_bf16_mixed_precision_train(plugin):
    check_precision(plugin)


def test_16_mixed_is_refused_for_its_loss_scaling():
    with pytest.raises(MisconfigurationException, match=r"precision='16-mixed'.*GradScaler.*fused into backward"):
        check_precision(MixedPrecision("16-mixed", "cpu"))


@pytest.mark.parametrize("plugin", [HalfPrecision("bf16-true"), HalfPrecision("16-true"), DoublePrecision()],
                         ids=["bf16-true", "16-true", "64-true"])
def test_true_precisions_are_refused_naming_the_flag(plugin):
    with pytest.raises(MisconfigurationException, match=rf"precision='{plugin.precision}'.*data_type=DataType.FP16"):
        check_precision(plugin)


def _tables(data_type: str) -> dict[str, TableInfo]:
    return {"small": TableInfo("ebc", "small", 10, 8, ["f"], 10, False, data_type)}


def test_a_half_table_is_not_made_data_parallel():
    assert validate_sharding_types({"small": "data_parallel"}, _tables("FP32"), {"ebc": ["data_parallel"]})
    with pytest.raises(ValueError, match=r"'small'.*dense optimizer.*FP16.*another sharding type"):
        validate_sharding_types({"small": "data_parallel"}, _tables("FP16"), {"ebc": ["data_parallel"]})


def test_table_dtypes_fbgemm_does_not_train_on_the_device_are_refused():
    check_data_types(_tables("FP16"), torch.device("cpu"))
    check_data_types(_tables("BF16"), torch.device("cuda"))
    with pytest.raises(ValueError, match=r"'small': 'BF16'.*on cpu take FP32, FP16 weights"):
        check_data_types(_tables("BF16"), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"'small': 'INT8'"):
        check_data_types(_tables("INT8"), torch.device("cuda"))
