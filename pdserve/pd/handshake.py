"""The P/D handshake: what a prefill worker tells a decode worker about itself.

D fetches `GET /internal/kv/agent_info` from P's own HTTP server once per
(engine id, epoch). Invariant: D uses a peer only when its compatibility hash
equals D's own (same model, dtype, geometry, layout, groups and protocol),
the engine id and epoch in the request's params match what P says now, and
P's transport record names that same engine and epoch. An answer is at most
`MAX_HANDSHAKE_BYTES`, and at most `max_cached_peers` answers are kept.
Torch-free.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
from typing import Any, Callable, Optional

import httpx

from pdserve.api.kv_transfer import (PROTOCOL_VERSION, AgentInfo, GroupWire, KVParamsInvalid, KVParamsStale,
                                     KVPullFailed, RemotePrefillParams, StateWire, url_host)
from pdserve.kv.specs import FullAttentionSpec, KVGroup, KVGroupPlan, RecurrentStateSpec
from pdserve.transfer.state_ranges import rank_state_spec

logger = logging.getLogger(__name__)

AGENT_INFO_PATH = "/internal/kv/agent_info"
TOKEN_HEADER = "X-Pdserve-Internal-Token"  # same header as pdserve.server.errors.INTERNAL_TOKEN_HEADER
MAX_HANDSHAKE_BYTES = 1 << 20  # an agent info answer is a few KiB (64 tensor-parallel ranks: a few hundred)
DEFAULT_MAX_CACHED_PEERS = 256  # prefill addresses whose answers are kept (least recently used dropped)


def groups_to_wire(plan: KVGroupPlan) -> list[GroupWire]:
    return [_group_to_wire(group) for group in plan.groups]


def _group_to_wire(group: KVGroup) -> GroupWire:
    spec, layer_ids = group.spec, list(group.layer_ids)
    if isinstance(spec, FullAttentionSpec):
        return GroupWire(kind="full", layer_ids=layer_ids)
    if isinstance(spec, RecurrentStateSpec):
        state = StateWire(mixer=spec.kind, conv_channels=spec.conv_channels, conv_window=spec.conv_window,
                          recurrent_shape=list(spec.recurrent_shape), dtype=spec.dtype)
        return GroupWire(kind="state", state=state, layer_ids=layer_ids)
    return GroupWire(kind="sliding", window_tokens=spec.window_tokens, layer_ids=layer_ids)


def compatibility_document(model_fingerprint: str, dtype: str, num_kv_heads: int, head_dim: int,
                           plan: KVGroupPlan, num_ranks: int = 1, kv_cache_dtype: str = "") -> dict[str, Any]:
    """What two workers must agree on to share KV. The model fingerprint covers weights identity
    (architecture, layer count, vocabulary, name); `num_kv_heads` and the recurrent state are the
    whole model's (`plan` is one rank's of `num_ranks`: workers of any TP sizes pair). The block size is not here: workers whose block sizes divide one another
    pair, reading in units of the smaller one (the admission checks it, from the peer's geometry).
    `kv_cache_dtype` is the pool's element type ("" or absent: the model's `dtype`): a page of one
    is never read as another. Each side sends its own, so a refusal can name what differs."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "model": model_fingerprint,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype or dtype,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "layout": "block,head,group_slot,kv,token,dim",
        "group_size": plan.group_size,
        "groups": [g.model_dump() for g in _compatibility_groups(plan, num_ranks)],
    }


def _compatibility_groups(plan: KVGroupPlan, num_ranks: int = 1) -> list[GroupWire]:
    """The attention groups as they are, and the state layers one entry per kind of state, whatever
    pages they share, its shape the whole model's: how many state layers a page holds follows the
    block size and the TP size, and state moves layer by layer between workers that cut them
    differently (pd/geometry.py `plan_handoff_pull`)."""
    wire = [_group_to_wire(group) for group in plan.groups if not group.is_state]
    merged: dict[RecurrentStateSpec, list[int]] = {}
    for group in plan.groups:
        if isinstance(group.spec, RecurrentStateSpec):
            merged.setdefault(rank_state_spec(group.spec, num_ranks, 1), []).extend(group.layer_ids)
    return wire + [_group_to_wire(KVGroup(len(wire) + index, spec, tuple(sorted(layer_ids))))
                   for index, (spec, layer_ids) in enumerate(merged.items())]


def compatibility_hash(document: dict[str, Any]) -> str:
    """Two workers may share KV only if this matches (the hash of `compatibility_document`)."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def state_layer_difference(own_groups: Any, their_groups: Any) -> str:
    """Why a peer cannot hold this worker's recurrent state, named ("" when both hold the same state
    layers in the same pages): the state layers it lacks, or how it pages them otherwise."""
    here, there = _state_pages(own_groups), _state_pages(their_groups)
    if here == there:
        return ""
    missing = sorted({layer for page in here for layer in page} - {layer for page in there for layer in page})
    extra = sorted({layer for page in there for layer in page} - {layer for page in here for layer in page})
    if missing or extra:
        return (f"recurrent-state layers {missing or 'none'} here are not state layers there, "
                f"{extra or 'none'} there are not here")
    return (f"recurrent-state layers listed {here} here, {there} there (a worker from before state moved "
            f"between block sizes lists them page by page, and its pages follow its --block-size: upgrade it)")


def _state_pages(groups: Any) -> list[list[int]]:
    """The layer ids of each state group of a compatibility document's groups."""
    if not isinstance(groups, list):
        return []
    return [list(group.get("layer_ids") or []) for group in groups
            if isinstance(group, dict) and group.get("kind") == "state"]


def _attention_groups(groups: Any) -> list[Any]:
    """The groups of a compatibility document that are not state groups."""
    if not isinstance(groups, list):
        return []
    return [group for group in groups if not (isinstance(group, dict) and group.get("kind") == "state")]


def incompatibilities(own: dict[str, Any], theirs: dict[str, Any], limit: int = 120) -> str:
    """What differs between two compatibility documents, named: "dtype: \"float32\" here, \"bfloat16\" there"."""
    differences = []
    state = state_layer_difference(own.get("groups"), theirs.get("groups"))
    if state:
        differences.append(state)
    for name in sorted(set(own) | set(theirs)):
        if name == "groups" and state and _attention_groups(own.get(name)) == _attention_groups(theirs.get(name)):
            continue  # only the state groups differ: said above
        if own.get(name) != theirs.get(name):
            here, there = (json.dumps(side.get(name))[:limit] for side in (own, theirs))
            differences.append(f"{name}: {here} here, {there} there")
    return "; ".join(differences) or "their compatibility hashes differ"


class HandshakeClient:
    """Fetches and caches peers' agent info; refreshes when a peer restarts.

    Requests that need the same peer at once share one fetch; answers are kept per address, the
    `max_cached_peers` most recently used (a params stream naming ever new addresses cannot grow
    it). The fetch's HTTP client speaks
    plain http to P's internal endpoint only: it loads no CA bundle (that blocked the event
    loop for about 50 ms per handshake) and ignores HTTP(S)_PROXY from the environment
    (an internal call must not leave through an operator's egress proxy)."""

    def __init__(self, own_hash: str, token: Optional[str], timeout_s: float = 5.0,
                 on_handshake: Callable[[], None] = lambda: None,
                 http_transport: Optional[httpx.AsyncBaseTransport] = None,
                 own_compatibility: Optional[dict[str, Any]] = None,
                 max_cached_peers: int = DEFAULT_MAX_CACHED_PEERS):
        """`http_transport` replaces the network (in-process tests route to a prefill app);
        `own_compatibility` (the document behind `own_hash`) lets a refusal say what differs."""
        self.http_transport = http_transport
        self.own_hash = own_hash
        self.own_compatibility = own_compatibility
        self.on_handshake = on_handshake
        self.token = token
        self.timeout_s = timeout_s
        self.max_cached_peers = max_cached_peers
        self._by_address: collections.OrderedDict[tuple[str, int], AgentInfo] = collections.OrderedDict()
        self._fetching: dict[tuple[str, int], asyncio.Task[AgentInfo]] = {}

    async def _fetch(self, host: str, port: int) -> AgentInfo:
        headers = {TOKEN_HEADER: self.token} if self.token else {}
        url = f"http://{url_host(host)}:{port}{AGENT_INFO_PATH}"
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, transport=self.http_transport, verify=False,
                                         trust_env=False) as client:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        raise KVPullFailed(f"prefill worker {host}:{port} refused the handshake "
                                           f"(HTTP {response.status_code})")
                    body = await _read_capped(response, f"{host}:{port}")
        except httpx.HTTPError as error:
            raise KVPullFailed(f"prefill worker {host}:{port} unreachable for handshake: {error!r}") from None
        try:
            info = AgentInfo.model_validate_json(body)
        except ValueError:  # pydantic's ValidationError included
            raise KVPullFailed(f"prefill worker {host}:{port} answered the handshake with malformed agent info") from None
        record = (info.transport.get("engine_id"), info.transport.get("epoch"))
        if record != (info.engine_id, info.epoch):
            raise KVPullFailed(f"prefill worker {host}:{port} is engine {info.engine_id!r} epoch {info.epoch!r}, but "
                               f"its transport record names engine {record[0]!r} epoch {record[1]!r}")
        self.on_handshake()
        logger.info("handshake with %s:%d: engine %s epoch %s", host, port, info.engine_id, info.epoch)
        return info

    async def _shared_fetch(self, address: tuple[str, int]) -> AgentInfo:
        """One fetch per address at a time; whoever asks meanwhile awaits the same answer. A
        caller that gives up (cancelled) does not cancel the fetch for the others."""
        task = self._fetching.get(address)
        if task is None:
            task = asyncio.ensure_future(self._fetch(*address))
            self._fetching[address] = task

            def settle(done: "asyncio.Task[AgentInfo]") -> None:
                if self._fetching.get(address) is done:
                    del self._fetching[address]
                if not done.cancelled() and done.exception() is None:
                    self._remember(address, done.result())

            task.add_done_callback(settle)
        return await asyncio.shield(task)

    def _remember(self, address: tuple[str, int], info: AgentInfo) -> None:
        self._by_address[address] = info
        self._by_address.move_to_end(address)
        while len(self._by_address) > self.max_cached_peers:
            self._by_address.popitem(last=False)

    @property
    def num_cached_peers(self) -> int:
        return len(self._by_address)

    async def peer_for(self, params: RemotePrefillParams) -> AgentInfo:
        """The verified agent info of the peer the params point at."""
        address = (params.remote_host, params.remote_port)
        info = self._by_address.get(address)
        if info is not None:
            self._by_address.move_to_end(address)
        if info is None or (info.engine_id, info.epoch) != (params.remote_engine_id, params.remote_epoch):
            info = await self._shared_fetch(address)
        if info.compat_hash != self.own_hash:
            why = (incompatibilities(self.own_compatibility, info.compatibility)
                   if self.own_compatibility is not None and info.compatibility else "")
            raise KVParamsInvalid(
                f"prefill worker {address[0]}:{address[1]} serves an incompatible model or KV layout"
                + (f" ({why})" if why else ""),
                param="kv_transfer_params",
            )
        if info.engine_id != params.remote_engine_id:
            raise KVParamsStale(f"kv_transfer_params.remote_engine_id {params.remote_engine_id!r} is not the engine at that address")
        if info.epoch != params.remote_epoch:
            raise KVParamsStale(f"kv_transfer_params.remote_epoch {params.remote_epoch!r} is stale: the prefill worker restarted")
        return info


async def _read_capped(response: httpx.Response, address: str) -> bytes:
    """The body of a handshake answer; KVPullFailed past MAX_HANDSHAKE_BYTES (read no further)."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_HANDSHAKE_BYTES:
        raise KVPullFailed(f"prefill worker {address} announced a handshake answer of {declared} bytes "
                           f"(at most {MAX_HANDSHAKE_BYTES})")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > MAX_HANDSHAKE_BYTES:
            raise KVPullFailed(f"prefill worker {address} sent a handshake answer over {MAX_HANDSHAKE_BYTES} bytes")
    return bytes(body)
