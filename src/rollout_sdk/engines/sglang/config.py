"""The SGLang engine's configuration: ``server_args()`` is the one place SGLang's arguments are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ...errors import ConfigError

__all__ = ["SglangEngineConfig"]


@dataclass(frozen=True, kw_only=True)
class SglangEngineConfig:
    """What :class:`SglangEngine` builds ``sglang.Engine`` from.  ``server_args()`` is the one place
    where SGLang's arguments are made."""

    model_path: str
    tp_size: int = 1
    #: first GPU of this engine's TP group (GPU = base_gpu_id + tp_rank)
    base_gpu_id: int = 0
    #: multi-node TP: nodes this engine spans, this node's index, and the torch.distributed address
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    mem_fraction_static: float | None = 0.8
    #: None lets SGLang choose; set it where FA3 is not installed ("triton" or "flashinfer")
    attention_backend: str | None = None
    sampling_backend: str | None = None
    #: "auto" loads the checkpoint; "dummy" makes random weights of the config's shape (benchmarks)
    load_format: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None
    max_running_requests: int | None = None
    #: sleep/wake (release/resume memory) needs the memory saver
    enable_memory_saver: bool = True
    #: keep a host copy of the weights so they survive release/resume
    weights_cpu_backup: bool = True
    #: per-request seeds (and batch-invariant kernels) at some cost in speed
    deterministic: bool = False
    skip_tokenizer_init: bool = True
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    random_seed: int = 0
    log_level: str = "warning"
    #: seconds allowed for the engine to start (model load, KV allocation, CUDA graphs)
    startup_timeout_s: float = 1200.0
    #: after start, move every object made so far (torch, SGLang, the model) out of the garbage collector's
    #: reach, in this process and in SGLang's scheduler (SGLang's ``freeze_gc``): a full collection over that
    #: heap stalled the event loop ~0.5 s per pass on an H200 (docs/benchmarks-changelog.md)
    freeze_gc: bool = True
    #: replace the radix cache's eviction, which rebuilds a heap of every cached leaf on each call, by an
    #: incremental one (engines/sglang/radix_patch.py): with tens of thousands of cached requests the old one
    #: made every decode step O(leaves) and long passes several times slower
    #: (docs/benchmarks.md#sglangs-radix-cache-eviction)
    incremental_eviction: bool = True
    #: how token-id requests reach SGLang: "direct" builds the scheduler's tokenized request itself and reads
    #: its outputs (engines/sglang/direct.py: no per-request tokenizer-manager work on the server's loop);
    #: "tokenizer_manager" goes through ``generate_request`` like ``Engine.async_generate``.  Images always
    #: take the tokenizer manager (SGLang's multimodal processing lives there).
    request_path: str = "direct"
    #: the most requests of ours decoding inside SGLang at once; the rest wait in the server, first come
    #: first served, and enter as running ones end.  "graph": the largest batch SGLang captured a CUDA graph
    #: for (``cuda_graph_max_bs``), so every decode step runs inside a graph: a 0.5B engine decoding 1,024
    #: requests at once ran ~1.6x slower than with 512
    #: (docs/benchmarks.md#grpo-groups-prefilled-once-and-the-decode-window);
    #: an int: that many; None: SGLang's own running limit alone
    decode_window: int | Literal["graph"] | None = "graph"
    #: GRPO groups (requests sharing a ``group_id``) whose prompt has at least this many tokens are
    #: prefilled once, by a prefill-only request their members wait for (engines/prefill.py); None: off
    prefill_once_min_tokens: int | None = 256
    #: agent sessions (``GenerateRequest.keep_kv_s``): pin a session's KV in the radix cache through its tool
    #: waits (engines/sglang/pins.py; needs ``incremental_eviction``'s plugin, i.e. rollout-sdk installed
    #: where SGLang's processes start); False: the requests' ``keep_kv_s`` is ignored
    keep_session_kv: bool = True
    #: session-level admission: a new session's first turn waits while the kept sessions' working set would
    #: exceed this fraction of the KV pool (engines/sessions.py); None: every session starts at once
    session_admission: float | None = None
    #: keep KV that leaves the GPU in host memory, this many times the GPU's KV pool (SGLang's hierarchical
    #: cache): an agent's context evicted during its tool wait is copied back instead of re-prefilled.  At 7B
    #: with 256 sessions on a 300k-token pool it cut re-prefill from 98% to 2.6% per resumed turn and the pass
    #: from 76 s to 50 s (docs/agents.md).  Pinned host memory: ratio x pool x bytes per token (57 KB at 7B);
    #: None: off
    host_kv_ratio: float | None = None
    #: before serving, run the request kinds the SDK sends (a prefill-only request, then two sampling ones
    #: with logprobs that take its prefix from the cache and decode together) and flush the cache: SGLang
    #: 0.5.16 compiles some CUDA kernels the first time a path runs (tvm-ffi, cached on disk under
    #: ``TVM_FFI_CACHE_DIR``), which on a machine without that cache stopped a 7B engine's scheduler 7-9 s
    #: at its first decode, in the middle of the first RL step (docs/design.md); warmed up, that time is
    #: part of the start-up.  False: serve at once
    warmup: bool = True
    #: any other ServerArgs field, passed through unchanged
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError("tp_size", self.tp_size, "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("node_rank", self.node_rank, f"must be in [0, nnodes={self.nnodes})")
        if self.request_path not in ("direct", "tokenizer_manager"):
            raise ConfigError("request_path", self.request_path, "must be 'direct' or 'tokenizer_manager'")
        window = self.decode_window
        if window not in (None, "graph") and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError("decode_window", window, "must be 'graph', an int >= 1 or None")
        if self.prefill_once_min_tokens is not None and (
            isinstance(self.prefill_once_min_tokens, bool)
            or not isinstance(self.prefill_once_min_tokens, int)
            or self.prefill_once_min_tokens < 1
        ):
            raise ConfigError("prefill_once_min_tokens", self.prefill_once_min_tokens, "must be an int >= 1 or None")
        ratio = self.host_kv_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 1 < ratio <= 64):
            raise ConfigError("host_kv_ratio", ratio, "must be in (1, 64] (the host pool is larger), or None")
        adm = self.session_admission
        if adm is not None and (isinstance(adm, bool) or not isinstance(adm, int | float) or not 0 < adm <= 4):
            raise ConfigError("session_admission", adm, "must be a fraction of the KV pool in (0, 4], or None")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("dist_init_addr", self.dist_init_addr, "is required when nnodes > 1")

    def server_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "base_gpu_id": self.base_gpu_id,
            "nnodes": self.nnodes,
            "node_rank": self.node_rank,
            "load_format": self.load_format,
            "dtype": self.dtype,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "enable_memory_saver": self.enable_memory_saver,
            "enable_weights_cpu_backup": self.enable_memory_saver and self.weights_cpu_backup,
            "enable_deterministic_inference": self.deterministic,
            "disable_cuda_graph": self.disable_cuda_graph,
            "disable_radix_cache": self.disable_radix_cache,
            "random_seed": self.random_seed,
            "log_level": self.log_level,
        }
        optional = {
            "dist_init_addr": self.dist_init_addr,
            "mem_fraction_static": self.mem_fraction_static,
            "attention_backend": self.attention_backend,
            "sampling_backend": self.sampling_backend,
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "cuda_graph_max_bs_decode": self.cuda_graph_max_bs,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        if self.host_kv_ratio is not None:
            args.update(enable_hierarchical_cache=True, hicache_ratio=float(self.host_kv_ratio))
        args.update(self.extra)
        return args
