"""What a worker refuses at start-up for a model with recurrent state, instead of computing wrong tokens."""

from __future__ import annotations

import pytest

from pdserve.api.config import ParallelConfig, ServerConfig, WorkerConfig
from pdserve.app.model_side import _check_state_support
from pdserve.kv.specs import FullAttentionSpec, RecurrentStateSpec
from pdserve.models.base import ModelSpec
from pdserve.models.hf_config import UnsupportedModelFeature

STATE = RecurrentStateSpec("gated_delta_net", 96, 3, (4, 16, 16))


def _spec(*layers) -> ModelSpec:
    return ModelSpec("qwen3_5", len(layers), 64, 4, 2, 16, 300, 512, tuple(layers))


def _config(role: str, tp: int) -> WorkerConfig:
    return WorkerConfig(role=role, server=ServerConfig(insecure_no_token=True),
                        parallel=ParallelConfig(tensor_parallel_size=tp))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_worker_of_a_state_model_runs_one_rank(role):
    with pytest.raises(UnsupportedModelFeature, match=f"a {role} worker of it runs one tensor-parallel rank"):
        _check_state_support(_config(role, 2), _spec(STATE, FullAttentionSpec()))


def test_what_is_served_passes():
    _check_state_support(_config("colocated", 2), _spec(STATE, FullAttentionSpec()))  # TP on one worker
    _check_state_support(_config("prefill", 1), _spec(STATE, FullAttentionSpec()))  # P/D on one rank each
    _check_state_support(_config("decode", 2), _spec(FullAttentionSpec()))  # no state: nothing to refuse
