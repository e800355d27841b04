"""Checks `kv_transfer_params` on the async side, before a request reaches the engine.

Invariant: the engine thread only ever sees remote-KV requests whose params are
well formed, whose peer answered the handshake with a matching compatibility
hash, engine id and epoch, and whose block lists fit that peer's pool and the
prompt's length. Everything else is a typed 4xx (or, for an unreachable peer,
per the failure policy). Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from pdserve.engine.decode_role import RemotePrefill
from pdserve.kv.block_pool import NULL_BLOCK_ID
from pdserve.kv.prefix import first_live_block
from pdserve.kv.specs import KVGroupPlan
from pdserve.request import GenerationRequest
from pdserve.transfer.handshake import AgentInfo, HandshakeClient
from pdserve.transfer.planner import validate_remote_block_ids
from pdserve.transfer.params import KVParamsInvalid, KVPullFailed, RemotePrefillParams, parse_remote_decode, parse_remote_prefill

logger = logging.getLogger(__name__)


def expected_block_counts(plan: KVGroupPlan, block_size: int, num_prompt_tokens: int) -> list[int]:
    """Per group, how many blocks a prefill worker hands over for this prompt."""
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    return [num_prompt_blocks - min(first_live_block(g, num_prompt_tokens - 1, block_size), num_prompt_blocks)
            for g in plan.groups]


def check_block_ids(params: RemotePrefillParams, agent: AgentInfo, plan: KVGroupPlan, block_size: int) -> None:
    """Shape and range of the block lists against the peer's pool and this prompt.
    Our prefill workers never send null entries, so none is accepted."""
    expected = expected_block_counts(plan, block_size, params.num_prompt_tokens)
    lists = validate_remote_block_ids(params.remote_block_ids, len(expected), agent.geometry.num_blocks, max(expected))
    for group_id, (ids, count) in enumerate(zip(lists, expected)):
        if len(ids) != count or NULL_BLOCK_ID in ids:
            raise KVParamsInvalid(
                f"kv_transfer_params.remote_block_ids[{group_id}] must name {count} non-null blocks "
                f"for {params.num_prompt_tokens} prompt tokens; got {len(ids)}"
            )


class PrefillFrontend:
    """P side: a do_remote_decode request computes the prompt and one token."""

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        if request.kv_transfer_params is None or parse_remote_decode(request.kv_transfer_params) is None:
            return dataclasses.replace(request, kv_transfer_params=None)
        sampling = dataclasses.replace(request.sampling, max_tokens=1, min_tokens=0)
        return dataclasses.replace(request, sampling=sampling, kv_transfer_params={"do_remote_decode": True})


class DecodeFrontend:
    """D side: verify params and peer, attach a `RemotePrefill` for the engine."""

    def __init__(self, handshake: HandshakeClient, plan: KVGroupPlan, block_size: int,
                 policy: Literal["recompute", "fail"]):
        self.handshake = handshake
        self.plan = plan
        self.block_size = block_size
        self.policy = policy

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        if request.kv_transfer_params is None:
            return request
        params = parse_remote_prefill(request.kv_transfer_params)
        local = dataclasses.replace(request, kv_transfer_params=None)
        if params is None:
            return local
        if params.num_prompt_tokens != len(request.prompt_token_ids):
            raise KVParamsInvalid(
                f"kv_transfer_params.num_prompt_tokens is {params.num_prompt_tokens} but the prompt has "
                f"{len(request.prompt_token_ids)} tokens here (different prompt or tokenizer)"
            )
        try:
            agent = await self.handshake.peer_for(params)
        except KVPullFailed:
            if self.policy == "fail":
                raise
            logger.warning("request %s: prefill worker unreachable; prefilling locally", request.request_id)
            return local
        check_block_ids(params, agent, self.plan, self.block_size)
        return dataclasses.replace(local, remote_prefill=RemotePrefill(params, agent))
