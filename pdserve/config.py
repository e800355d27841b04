"""Frozen configuration of a worker, one sub-config per component.

Built once by the CLI (or a test) and passed down; nothing reads flags or
environment variables after start-up.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Frozen):
    path: Optional[str] = None  # HF directory or .gguf file; None = embedded SmolLM2
    served_name: Optional[str] = None  # id in /v1/models; defaults to the model's own name
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: Optional[int] = None  # defaults to the model's max positions
    # CPU threads for torch; None keeps torch's default (all cores). Set it when
    # several workers share one host, or they fight over the same cores.
    num_threads: Optional[int] = Field(None, ge=1)
    # Weights kept as quantized blocks. auto: on the CPU a GGUF's Q4_0/Q4_1/Q8_0
    # tensors stay packed, unless dtype is "float32" (the exact mode: everything
    # dequantized); int8 / int4: float weights of linear layers are quantized at
    # load as well.
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # Compile the decode step (torch.compile). None: on for CUDA (graphs); off on
    # the CPU, where a cold compile costs more start-up than its steps save back
    # soon (True compiles there too, given the native kernels and float32).
    compile: Optional[bool] = None


class CacheConfig(_Frozen):
    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: Optional[int] = Field(None, ge=2)  # wins over kv_memory_bytes
    kv_memory_bytes: int = Field(1 << 30, ge=1 << 20)
    enable_prefix_caching: bool = True


class SchedulerConfig(_Frozen):
    max_num_batched_tokens: int = Field(512, ge=1)  # per-step token budget (chunked prefill)
    max_num_running: int = Field(64, ge=1)
    max_num_waiting: int = Field(1024, ge=1)  # past this, new requests get 503


class ServerConfig(_Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    internal_token: Optional[str] = None  # guards internal (KV) endpoints
    log_level: str = "info"
    # On SIGTERM: how long to wait for in-flight requests (and, on a prefill
    # worker, pinned blocks) before aborting them and exiting.
    drain_timeout_s: float = Field(60.0, ge=0)


class TransferConfig(_Frozen):
    engine_id: Optional[str] = None  # stable name of this worker; default host:port
    advertise_host: Optional[str] = None  # address decode workers reach us on; default server.host
    lease_s: float = Field(30.0, gt=0)  # P keeps unread blocks this long without a heartbeat
    heartbeat_s: float = Field(5.0, gt=0)  # D renews leases of queued requests this often
    pull_timeout_s: float = Field(30.0, gt=0)  # D gives up on a READ after this long
    handshake_timeout_s: float = Field(5.0, gt=0)
    failure_policy: Literal["recompute", "fail"] = "recompute"


class WorkerConfig(_Frozen):
    # colocated: one worker, no KV transport; decode/prefill: the two P/D halves.
    role: Literal["colocated", "decode", "prefill"] = "colocated"
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    transfer: TransferConfig = TransferConfig()
