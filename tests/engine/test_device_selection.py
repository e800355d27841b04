"""--device auto|cpu|cuda|cuda:N: parsed once, resolved to an indexed device, refused clearly."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from pdserve.api.config import ModelConfig
from pdserve.api.flags import worker_config
from pdserve.app.cli import build_parser
from pdserve.runner.devices import pick_device
from tests.devices import cuda_available


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_names_are_accepted_by_the_cli_and_the_config(device):
    args = build_parser().parse_args(["decode", "--device", device])
    assert worker_config(args, "decode").model.device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda1", "CPU", "cuda:0,1"])
def test_other_device_names_are_refused_by_the_cli_and_the_config(device, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", device])
    assert "not a device" in capsys.readouterr().err
    with pytest.raises(ValidationError):
        ModelConfig(device=device)


def test_cpu_and_auto_without_cuda_resolve_to_the_cpu():
    assert pick_device("cpu") == torch.device("cpu")
    if not cuda_available():
        assert pick_device("auto") == torch.device("cpu")


@pytest.mark.skipif(cuda_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        pick_device("cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs CUDA")
def test_cuda_resolves_to_an_indexed_device_and_a_missing_index_is_a_clear_error():
    assert pick_device("cuda").index is not None
    last = torch.cuda.device_count() - 1
    assert pick_device(f"cuda:{last}") == torch.device("cuda", last)
    assert torch.cuda.current_device() == last
    with pytest.raises(ValueError, match="CUDA device"):
        pick_device(f"cuda:{last + 1}")
    pick_device("cuda:0")
