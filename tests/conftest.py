"""Fixtures and session checks shared by every test package."""

from __future__ import annotations

import logging
import os

import pytest

from tests.devices import device_params
from tests.file_budget import pytest_addoption, pytest_configure  # noqa: F401 - the hooks: seconds per test file
from tests.file_order import integration_files_first
from tests.process_guard import pytest_sessionfinish  # noqa: F401 - the hook: no test may leave a process behind
from tests.unique_node_ids import give_each_test_its_own_node_id
from tests.worker_logs import pytest_runtest_makereport  # noqa: F401 - the hook: a failure shows its workers' logs


@pytest.fixture(scope="session", params=device_params())
def device(request) -> str:
    """The device a test runs on: "cpu" in CI, also "cuda" where there is a GPU."""
    return request.param


@pytest.fixture(scope="session")
def hf_smollm2_model():
    """transformers' LlamaForCausalLM from the embedded GGUF, dequantized by its own code: the oracle of
    the model and engine tests, loaded once a run (about 20 s on one core) and only read.

    transformers refuses GGUF files unless `accelerate` is importable, which it
    only uses to dispatch across several devices; we load on one CPU, so the
    gate is lifted for this load only.
    """
    transformers = pytest.importorskip("transformers")
    import torch
    import transformers.modeling_utils as modeling_utils

    from pdserve.models.loader import embedded_model_path

    path = embedded_model_path()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()


def pytest_collection_modifyitems(items) -> None:  # noqa: ANN001 (pytest's hook signature)
    """One node id per test (pytest-xdist schedules by it), and the files that start processes first."""
    give_each_test_its_own_node_id(items)
    integration_files_first(items)


def pytest_sessionstart(session) -> None:  # noqa: ANN001 (pytest's hook signature)
    """Builds pdserve's native CPU kernels once, before any test starts a worker process, so that
    workers find them cached instead of each compiling them (racing, and eating their start-up
    timeout on a busy machine). A machine that cannot build them logs why and runs the torch paths."""
    from pdserve.kernels import native

    reason = native.cpu_kernels_error()
    if reason is not None:
        logging.getLogger(__name__).warning("native CPU kernels unavailable for this run: %s", reason)
