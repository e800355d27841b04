"""Frozen configuration of a worker, one sub-config per component: the single home of every setting.

Each field declares its default, its constraints, its help text and (where
it differs from the field name) its command-line flag; `pdserve/api/flags.py`
builds the flags of `pdserve serve|prefill|decode|up` from these models, so a
setting is written once. Built once at start-up and passed down; nothing
reads flags or environment variables afterwards.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["colocated", "decode", "prefill"]
DEFAULT_PORTS: dict[str, int] = {"colocated": 8000, "prefill": 8100, "decode": 8200}
# "auto" (CUDA if present, else CPU), "cpu", "cuda" (the current CUDA device) or "cuda:N".
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
# --batch-activation-bits -> 7-bit digits per activation in pdserve/kernels/q4_1_lanes.cpp
BATCH_ACTIVATION_DIGITS: dict[int, int] = {22: 3, 15: 2, 8: 1}


def setting(default: Any, help: str, *, flag: Optional[str] = None, env: Optional[str] = None,
            parse: Optional[str] = None, alias: Optional[str] = None, **constraints: Any) -> Any:
    """A config field with its CLI metadata: `flag` overrides the derived --field-name,
    `env` names a variable that supplies the value when the flag is absent,
    `parse` names a special parser ("bytes", "size_or_auto", "device": see pdserve.api.flags.PARSERS),
    `alias` a second, short flag."""
    extra = {key: value for key, value in (("flag", flag), ("env", env), ("parse", parse), ("alias", alias))
             if value is not None}
    return Field(default, description=help, json_schema_extra=extra or None, **constraints)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    path: Optional[str] = setting(None, "HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
                                  flag="--model")
    served_name: Optional[str] = setting(None, "model id in /v1/models (default: the model's own name)",
                                         flag="--served-model-name")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA); the KV pool's is "
                "--kv-cache-dtype's")
    device: str = setting("auto", "where the model and the KV pool live: auto (CUDA if present), cpu, cuda or "
                                  "cuda:N; NIXL registers the pool under that device", parse="device",
                          pattern=DEVICE_PATTERN)
    max_model_len: Optional[int] = setting(None, "context limit in tokens (default: the model's max positions)",
                                           ge=1)
    num_threads: Optional[int] = setting(
        None, "torch CPU threads (default: all cores); set it when several workers share a host", ge=1)
    core_ledger: Optional[str] = setting(
        None, "a file a prefill and a decode worker on one host share (pdserve up makes it): each runs "
              "--num-threads while the other has work and --num-threads-alone while it is idle "
              "(pdserve/engine/core_share.py)")
    num_threads_alone: Optional[int] = setting(
        None, "with --core-ledger: torch threads while the other worker is idle (default: all cores)", ge=1)
    quantization: Literal["auto", "none", "int8", "int4"] = setting(
        "auto", "weights kept as quantized blocks. auto: on the CPU a GGUF's Q4_0/Q4_1/Q8_0 tensors stay packed, "
                "unless --dtype float32 (the exact mode: everything dequantized); int8/int4: float weights of "
                "linear layers are quantized at load as well")
    compile: Optional[bool] = setting(
        None, "compile the decode step (torch.compile; CUDA graphs on a GPU). Off unless asked: on the CPU a cold "
              "compile costs more start-up than its steps save back soon, and the CUDA-graph variant does not "
              "yet run on a GPU (docs/benchmarks.md, GPU)")
    batch_activation_bits: int = setting(
        22, "bits per block of 32 activations that the Q4_1 products of batched decode steps round to (the fused "
            "CPU layers, 12+ rows on AVX-512 VNNI; 8+ at 8 bits): 22, the one-row kernel's rounding, so a request's tokens do not depend on its "
            "batch; 15 or 8 (llama.cpp's) are faster and may change greedy tokens (docs/benchmarks.md, "
            "\"Where a decode step goes\")")

    one_row_tiles: bool = setting(
        True, "on a CPU with AVX-512 VNNI, keep a second copy of each Q4_1 weight laid out for decode "
              "steps of 1-2 rows: their products ~1.1x faster at one row, each row to its batch-1 bits, for as much "
              "memory again as the Q4_1 weights (docs/operations.md, \"Flags that matter\")")

    @field_validator("batch_activation_bits")
    @classmethod
    def _known_bits(cls, bits: int) -> int:
        if bits not in BATCH_ACTIVATION_DIGITS:
            raise ValueError(f"--batch-activation-bits must be one of {sorted(BATCH_ACTIVATION_DIGITS)}, not {bits}")
        return bits


class CacheConfig(_Frozen):
    block_size: int = setting(16, "tokens per KV block", ge=1, le=1024)
    num_blocks: Optional[int] = setting(None, "pool size in blocks (wins over --kv-memory)", ge=2)
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = setting(
        "auto", "element type of the KV pool: 16-bit halves the bytes a decode step reads and doubles the blocks "
                "per GiB; attention still sums in float32 (auto: bfloat16 where decode runs the fused native "
                "layers, a Llama-family model on the CPU, unless --dtype float32 (the exact mode); else the "
                "model's dtype; docs/kv-layout.md). Workers sharing KV must agree")
    kv_memory_bytes: Optional[int] = setting(
        None, "pool size in bytes, e.g. 512MiB or 2GiB; auto (the default): on CUDA sized from the GPU's free "
              "memory after the weights (see --gpu-memory-utilization and docs/kv-layout.md), 1GiB on CPU",
        flag="--kv-memory", parse="size_or_auto", ge=1 << 20)
    gpu_memory_utilization: float = setting(
        0.9, "CUDA with --kv-memory auto: the share of the whole GPU this worker may hold (weights, step "
             "workspace, pool)", gt=0, le=1)
    enable_prefix_caching: bool = setting(True, "reuse the KV of prompt prefixes seen before", flag="--prefix-caching")
    kv_offload_bytes: Optional[int] = setting(
        None, "size of a host-memory tier behind the pool, e.g. 4GiB: prefix blocks evicted from the pool are "
              "copied there and loaded back on a later hit instead of being recomputed (default: off)",
        flag="--kv-offload-bytes", parse="bytes", ge=1)
    kv_offload_dir: Optional[str] = setting(
        None, "keep the offload tier (--kv-offload-bytes) in a file under this directory (local NVMe) instead of "
              "host memory; wiped at start-up, locked against a second worker", flag="--kv-offload-dir")
    state_snapshot_interval_blocks: Optional[int] = setting(
        None, "recurrent-state models: snapshot the state for the prefix cache every this many blocks besides "
              "each prompt's last full block (0: there only; default: ceil(state groups / attention "
              "groups) blocks, so a cached prefix's snapshots take at most as many pages as its KV)",
        flag="--state-snapshot-interval", ge=0)


class SchedulerConfig(_Frozen):
    max_num_batched_tokens: int = setting(512, "per-step token budget (longer prompts are chunked)", ge=1)
    max_num_running: int = setting(64, "requests computed together (including those waiting for remote KV)", ge=1)
    max_num_waiting: int = setting(1024, "queued requests past which new ones get 503", ge=1)
    max_step_ms: Optional[float] = setting(
        None, "while streams are decoding, cap a step's tokens so that it lasts about this long, from measured "
              "step times: prompts computed here are cut into chunks the streams barely notice (set it to the "
              "TPOT you promise; default: off, every step may take --max-num-batched-tokens)", gt=0)


class LimitsConfig(_Frozen):
    """Bounds on what one request may ask, checked before any work (pdserve/api/validation.py).
    The proxy applies the same model with the same defaults (proxy/config.py)."""

    max_body_bytes: int = setting(8 << 20, "largest request body; larger ones get 413", parse="bytes", ge=1 << 10)
    max_json_depth: int = setting(32, "deepest nesting of a request's JSON (400 beyond)", ge=4, le=128)
    max_prompt_chars: int = setting(
        1_000_000, "longest text prompt (chat: all message texts together), checked before tokenizing", ge=1)
    max_messages: int = setting(1024, "most messages in one chat request", ge=1)
    max_stop_strings: int = setting(16, "most stop strings in one request", ge=0)
    max_stop_string_chars: int = setting(256, "longest stop string", ge=1)
    max_stop_token_ids: int = setting(64, "most stop_token_ids in one request", ge=0)
    max_prompts: int = setting(256, "most prompts in one batched completion request", ge=1)
    max_choices: int = setting(
        256, "most answers one request may ask for (n times its prompts): each is an engine request", ge=1)
    max_logit_bias_entries: int = setting(1024, "most logit_bias entries in one request", ge=0)
    max_output_entries: int = setting(
        1 << 22, "most token entries one request's answer may hold: for each answer (n times the prompts), "
                 "max_tokens (absent: the rest of the context) times 1 + top_logprobs, plus with echoed "
                 "logprobs the prompt's tokens times 1 + logprobs (400 beyond; bounds the answer's memory)", ge=1)
    max_tools: int = setting(128, "most tools in one chat request", ge=0)
    max_constraint_chars: int = setting(
        65_536, "largest output constraint (response_format, guided_*, tools as JSON text), before compiling", ge=1)
    header_timeout_s: float = setting(
        10.0, "a client must send a request's headers within this long, or its connection is closed", gt=0)
    body_timeout_s: float = setting(30.0, "a client must send a request's body within this long (408 otherwise)",
                                    gt=0)


def check_token(token: Optional[str]) -> Optional[str]:
    """An unset token means none; an empty one is a mistake (it would look set and guard nothing)."""
    if token is not None and not token.strip():
        raise ValueError("the internal token must not be empty (leave it unset for none)")
    return token


def is_loopback_host(host: str) -> bool:
    """True for addresses only this machine can reach (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


PIN_LIFETIME_LEASES = 10  # --kv-max-pin-s by default: ten leases (300 s with the default lease)


class ServerConfig(_Frozen):
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on (default per role: serve 8000, prefill 8100, decode 8200)",
                        ge=0, le=65535)
    internal_port: Optional[int] = setting(
        None, "port of the internal listener (same --host): the only place the /internal/* routes (KV handshake, "
              "release, routing info, KV events, prefix-cache reset) are served; the serving port answers 404 for "
              "them (default: --port + 1)", ge=0, le=65535)
    internal_token: Optional[str] = setting(
        None, "shared token guarding internal endpoints and kv_transfer_params (prefer the variable: flags show "
              "in process listings); P and D bound to a non-loopback --host refuse to start without it",
        env="PDSERVE_INTERNAL_TOKEN")
    insecure_no_token: bool = setting(
        False, "let a prefill or decode worker listen on a non-loopback address without an internal token (anyone "
               "who reaches its port can then make it pin, read or release KV memory), and open any worker's "
               "internal KV-event routes there without one",
        flag="--insecure-no-token")
    max_concurrent_streams: int = setting(
        256, "streamed answers open at once; past this a new streamed request gets 503", ge=1)
    stream_send_timeout_s: float = setting(
        30.0, "drop a streamed answer whose client takes no part of an event for this long (it stopped reading): "
              "its stream slot and request are freed", gt=0)
    log_level: Literal["debug", "info", "warning", "error"] = setting("info", "log verbosity")
    drain_timeout_s: float = setting(
        60.0, "on SIGTERM, wait this long for in-flight work (and pinned KV) before exiting", ge=0)

    @field_validator("internal_token")
    @classmethod
    def _token_not_empty(cls, token: Optional[str]) -> Optional[str]:
        return check_token(token)

    @model_validator(mode="after")
    def _internal_port_is_its_own(self) -> "ServerConfig":
        if self.internal_port is None and self.port == 65535:
            raise ValueError("--port 65535 leaves no default internal port (--port + 1): pass --internal-port")
        if self.internal_port is not None and self.internal_port == self.port != 0:
            raise ValueError(f"--internal-port must differ from --port ({self.port}): the internal routes must not "
                             "share the serving port")
        return self

    @property
    def internal_listen_port(self) -> int:
        """The internal listener's port: --internal-port, else the serving port + 1 (0, any free port,
        with --port 0: the worker binds both before it loads and records the ports it got). Peers reach
        the internal routes here (P names it in its kv_transfer_params' remote_port)."""
        if self.internal_port is not None:
            return self.internal_port
        return self.port + 1 if self.port else 0


class TransferConfig(_Frozen):
    engine_id: Optional[str] = setting(None, "stable worker name (default: role-hostname-port)")
    advertise_host: Optional[str] = setting(None, "address peers reach this worker on (default: --host)")
    lease_s: float = setting(30.0, "how long a prefill worker keeps unread KV without news from its reader "
                                   "(set the same value on decode workers: it bounds their pull timeout)",
                             flag="--kv-lease-s", gt=0)
    max_pin_s: Optional[float] = setting(
        None, "P: the longest a prefill's KV stays pinned, renewals included (a decode worker that keeps renewing "
              "cannot hold it longer; default: 10 leases)", flag="--kv-max-pin-s", gt=0)
    heartbeat_s: float = setting(5.0, "D: renew leases of queued and in-flight pulls this often",
                                 flag="--kv-heartbeat-s", gt=0)
    pull_timeout_s: float = setting(10.0, "D: give up on a KV read after this long (at most half the lease)",
                                    flag="--kv-pull-timeout-s", gt=0)
    handshake_timeout_s: float = setting(5.0, "D: give up on a prefill worker's handshake after this long",
                                         flag="--kv-handshake-timeout-s", gt=0)
    ticket_wait_s: float = setting(
        130.0, "D: the longest a decode leg sent beside its prefill leg (concurrent legs) waits for the proxy to "
               "deliver P's answer; then it fails (503) and holds nothing (longer than the proxy's prefill timeout)",
        flag="--kv-ticket-wait-s", gt=0)
    reserve_before_ticket: bool = setting(
        True, "D: a decode leg sent beside its prefill leg enters the engine at once, which reserves its prompt's "
              "blocks while P computes and pulls the moment P's answer comes (off: it enters once the answer came)",
        flag="--kv-reserve-before-ticket")
    connect_timeout_s: float = setting(5.0, "D: give up setting up a prefill worker's data path after this long",
                                       flag="--kv-connect-timeout-s", gt=0)
    failure_policy: Literal["recompute", "fail"] = setting(
        "recompute", "D: on a failed pull, prefill locally (recompute) or answer 503 kv_pull_failed (fail)",
        flag="--kv-failure-policy")
    max_pinned_share: float = setting(
        0.5, "P: refuse new remote-decode prefills (503 + Retry-After) while blocks pinned for decode workers "
             "exceed this share of the pool (P and D: peer pins past it are refused too)",
        flag="--kv-max-pinned-share", gt=0, le=1)
    agent_isolation: Literal["auto", "process", "inline"] = setting(
        "auto", "where this worker's NIXL agent runs: process (its own child process, sharing the pool's host "
                "memory: a crash inside NIXL or UCX fails the reads in flight and the agent is restarted, the worker "
                "lives on), inline (in the worker: a crash there kills the worker), auto (process for host-memory "
                "pools, inline on a GPU)", flag="--kv-agent-isolation")
    allowed_peers: Optional[str] = setting(
        None, "D: comma-separated prefill hosts and CIDRs this worker may fetch KV from (default: any); a host "
              "name matches only itself, an IP literal must lie in a listed address or CIDR; so must every IP the "
              "peer's UCX address (in its NIXL metadata) offers, unless it is this host's own and the handshake "
              "went to loopback",
        flag="--kv-allowed-peers")

    peer_pull: bool = setting(
        True, "pull a prompt's prefix from the peer the proxy's hint names instead of computing it, and pin this "
              "worker's prefixes (a decode worker's include its answers) for peers that ask", flag="--peer-pull")
    peer_pull_min_tokens: int = setting(
        64, "pull from a peer only prefixes of at least this many tokens (a floor under --peer-pull-decision)",
        flag="--peer-pull-min-tokens", ge=1)
    peer_pull_decision: Literal["measured", "threshold"] = setting(
        "measured", "when to follow a peer hint: measured (when this worker's own measured prefill and pull times "
                    "predict the pull faster, docs/operations.md), threshold (whenever the prefix reaches "
                    "--peer-pull-min-tokens)", flag="--peer-pull-decision")

    @field_validator("allowed_peers")
    @classmethod
    def _check_allowed_peers(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_peer_allow_list(value)
        return value

    def isolates_agent(self, device_type: str) -> bool:
        """Whether the NIXL agent runs in its own process on a pool on `device_type` ("cpu", "cuda")."""
        return self.agent_isolation == "process" or (self.agent_isolation == "auto" and device_type == "cpu")

    @property
    def pin_lifetime_s(self) -> float:
        """How long P may keep a pin, renewals included."""
        return self.max_pin_s if self.max_pin_s is not None else PIN_LIFETIME_LEASES * self.lease_s


def parse_peer_allow_list(text: str) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """'p0.svc, 10.0.0.0/24, 10.1.2.3' -> (host names, ip networks); raises ValueError on an empty entry."""
    names: list[str] = []
    networks: list[Any] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            raise ValueError(f"--kv-allowed-peers has an empty entry: {text!r}")
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            names.append(entry.lower())
    return tuple(names), tuple(networks)


class ParallelConfig(_Frozen):
    tensor_parallel_size: int = setting(
        1, "ranks (processes, one device each) one worker's model is split over, Megatron-style; the head count "
           "must divide by it", alias="-tp", ge=1, le=64)
    tp_rank: Optional[int] = setting(
        None, "this process's rank when every rank starts as its own command (several hosts: one command per "
              "rank, e.g. a LeaderWorkerSet); unset: rank 0 starts the other ranks on this host", ge=0)
    tp_master_addr: str = setting("127.0.0.1", "address of rank 0's rendezvous (torch.distributed TCP store)")
    tp_master_port: Optional[int] = setting(
        None, "port of rank 0's rendezvous (needed with --tp-rank; default on one host: a free port)", ge=1, le=65535)
    tp_timeout_s: float = setting(
        30.0, "a collective that does not complete in this many seconds means a rank is lost: the worker exits "
              "non-zero (its orchestrator restarts it)", gt=0)
    tp_shared_memory: bool = setting(
        True, "ranks that share this host's memory (checked at start-up) all-reduce through a shared-memory "
              "segment instead of gloo (CPU, x86-64); off: gloo for every collective")
    tp_native_all_reduce: bool = setting(
        True, "over the shared-memory segment, all-reduce in native code (a fused decoder stack then runs a "
              "whole step in one native call); off: the same protocol in Python (a fallback; slower)")
    tp_join_timeout_s: float = setting(
        600.0, "how long ranks wait at start-up for all of them to join (ranks on other hosts may start minutes "
               "apart)", gt=0)

    @model_validator(mode="after")
    def _rank_fits(self) -> "ParallelConfig":
        if self.tp_rank is not None and self.tp_rank >= self.tensor_parallel_size:
            raise ValueError(f"--tp-rank {self.tp_rank} is not below --tensor-parallel-size "
                             f"{self.tensor_parallel_size}")
        if self.tp_rank is not None and self.tp_master_port is None:
            raise ValueError("--tp-rank needs --tp-master-port (every rank meets rank 0 there)")
        return self

    @property
    def is_leader(self) -> bool:
        """Rank 0: the HTTP server, the scheduler and the KV manager live here."""
        return not self.tp_rank


class WorkerConfig(_Frozen):
    # colocated: one worker, no KV transport; decode/prefill: the two P/D halves.
    role: Role = "colocated"
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    transfer: TransferConfig = TransferConfig()
    limits: LimitsConfig = LimitsConfig()
    parallel: ParallelConfig = ParallelConfig()

    @property
    def keeps_one_row_tiles(self) -> bool:
        """--one-row-tiles where small decode steps run: a prefill worker hands every request to
        decode after its first token, so the second copy of its weights would only take memory."""
        return self.model.one_row_tiles and self.role != "prefill"

    @model_validator(mode="after")
    def _internal_endpoints_need_a_token_off_loopback(self) -> "WorkerConfig":
        # P and D expose endpoints that pin, read and release KV memory; on an
        # address others can reach, that needs the shared token.
        server = self.server
        if self.role != "colocated" and server.internal_token is None and not server.insecure_no_token \
                and not is_loopback_host(server.host):
            raise ValueError(f"a {self.role} worker listening on {server.host} needs an internal token "
                             "($PDSERVE_INTERNAL_TOKEN or --internal-token); pass --insecure-no-token to run "
                             "without one anyway")
        return self

    @model_validator(mode="after")
    def _a_pin_outlives_one_lease(self) -> "WorkerConfig":
        if self.transfer.max_pin_s is not None and self.transfer.max_pin_s < self.transfer.lease_s:
            raise ValueError(f"--kv-max-pin-s ({self.transfer.max_pin_s:g}) must be at least --kv-lease-s "
                             f"({self.transfer.lease_s:g})")
        return self

    @model_validator(mode="after")
    def _decode_timeouts_fit_in_the_lease(self) -> "WorkerConfig":
        # A READ that outlives half the lease might land after P freed and reused
        # its pages; D would then treat it as failed, so a longer timeout is useless.
        transfer = self.transfer
        if self.role == "decode" and transfer.pull_timeout_s > transfer.lease_s / 2:
            raise ValueError(f"--kv-pull-timeout-s ({transfer.pull_timeout_s:g}) must be at most half of "
                             f"--kv-lease-s ({transfer.lease_s:g}): a slower read could land after the prefill "
                             "worker freed its pages")
        if self.role == "decode" and transfer.heartbeat_s >= transfer.lease_s / 2:
            raise ValueError(f"--kv-heartbeat-s ({transfer.heartbeat_s:g}) must be under half of "
                             f"--kv-lease-s ({transfer.lease_s:g})")
        return self
