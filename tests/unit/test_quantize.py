import pytest
import torch

from tuneline.stages.train.quantize import check_supported


def test_fp8_refused_on_cpu_naming_the_field():
    with pytest.raises(ValueError, match="model.quantize fp8"):
        check_supported("fp8", torch.device("cpu"))


def test_int8_accepted_on_cpu():
    check_supported("int8", torch.device("cpu"))
