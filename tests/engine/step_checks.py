"""One check the fused-layer tests share: a decode step run by the worker's runner computes what a
per-op `DecodeStep` computes from the same pool (logits and the KV it writes, within `tolerance`,
and the same greedy tokens)."""

from __future__ import annotations

import torch


def assert_step_matches_per_op(runner, per_op, chunks: list, before: torch.Tensor, tolerance: float) -> None:
    """Runs `chunks` through `per_op` and through `runner.decode_step`, each from the pool `before`;
    leaves the pool as the runner's step wrote it."""
    runner.pool.copy_(before)
    with torch.inference_mode():
        expected_logits = per_op.run(chunks)
    expected_pool = runner.pool.clone()
    runner.pool.copy_(before)
    with torch.inference_mode():
        logits = runner.decode_step.run(chunks)
    torch.testing.assert_close(logits, expected_logits, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(runner.pool, expected_pool, rtol=tolerance, atol=tolerance)
    assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))
