"""Server arguments: one dataclass (SGLang's field names, flags and defaults), its CLI, validation,
and the resolutions SGLang applies.

``__post_init__`` validates (one ``ValueError`` naming every bad flag) and resolves what SGLang
resolves, with a warning recorded in ``args.resolutions``; ``args.check_runtime_supported()``
refuses features accepted but not run. ``python server_args.py [flags]`` prints the result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

WRITE_POLICY_CHOICES = ("write_through", "write_through_selective", "write_back")
IO_BACKEND_CHOICES = ("kernel", "direct")
MEM_LAYOUT_CHOICES = ("layer_first", "page_first", "page_first_direct")
DISAGGREGATION_MODE_CHOICES = ("null", "prefill", "decode")
# "simulated": the in-process decode simulation (this project's default, deterministic);
# "mooncake": a real decode worker, KV over Mooncake's transfer engine (SGLang's default).
TRANSFER_BACKEND_CHOICES = ("simulated", "mooncake")
DECODE_ALLOCATION_POLICY_CHOICES = ("early", "prefill_complete")
DEVICE_CHOICES = ("auto", "cuda", "cpu")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
MODEL_PRESET_CHOICES = ("tiny", "llama3-8b-shape", "deepseek-v2-lite-shape", "deepseek-v3-shape")
PREFETCH_POLICY_CHOICES = ("best_effort", "wait_complete", "timeout")
HOST_MEMORY_MODE_CHOICES = ("cache", "buffer_only")
EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
BUFFER_ONLY_WRITE_BACK = (
    "--hicache-host-memory-mode buffer_only resolves --hicache-write-policy write_back to "
    "write_through"
)

# Upstream warning texts of the optimistic-prefill gate (first match wins), then of the layout /
# io backend resolutions.
GATE_PP = "Optimistic prefill does not support pp_size > 1"
GATE_HICACHE = "Optimistic prefill only supports L2 hierarchical cache with write-back policy"
GATE_MAMBA = "Optimistic prefill does not support models that use mamba radix cache."
GATE_HICACHE_WRITE_THROUGH = (
    "Optimistic prefill supports L2 write-back/write-through or "
    "L3 buffer-only write-through hierarchical cache"
)
PREFILL_COMPLETE_FORCES_ATTEMPTS = (
    "prefill_complete retains KV on prefill until prefill finishes: optimistic prefill on"
)
PREFILL_COMPLETE_NEEDS_ATTEMPTS = (
    "prefill_complete requires optimistic prefill, but the resolved model/cache configuration "
    "disabled it."
)
LAYOUT_DIRECT_NEEDS_DIRECT_IO = "Page first direct layout only support direct io backend"
LAYOUT_PAGE_FIRST_WITH_DIRECT_IO = (
    "Page first layout is not supported with direct IO backend, "
    "switching to page first direct layout"
)
LAYOUT_MOONCAKE_LAYER_FIRST = (
    "Mooncake/Ascend MemCache storage backend does not support layer_first layout, "
    "switching to {layout} layout for {io} io backend"
)
STORAGE_BACKENDS_WITHOUT_LAYER_FIRST = ("mooncake",)

# Model presets (random weights): the 8B-shaped one has Llama-3-8B's KV geometry with a smaller
# vocabulary so the random weights stay affordable.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        num_layers=4,
        num_attention_heads=4,
        head_num=2,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
    ),
    "llama3-8b-shape": dict(
        num_layers=32,
        num_attention_heads=32,
        head_num=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=32000,
    ),
}
GEOMETRY_FIELDS = tuple(MODEL_PRESETS["tiny"])

# Unset MLA fields (``--use-mla``) take the preset's values or DeepSeek's own.
MLA_DEFAULTS: dict[str, int] = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=0
)
MLA_FIELDS = tuple(MLA_DEFAULTS)

# DeepSeek-V2-Lite's and V3's attention / KV geometry (MLA: they need --use-mla), every MLP dense
# and as wide as the experts one token activates, the vocabulary cut to 32000.
_DEEPSEEK_KV = dict(head_num=1, head_dim=192, vocab_size=32000, **MLA_DEFAULTS)
MLA_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite-shape": dict(
        _DEEPSEEK_KV,
        num_layers=27,
        num_attention_heads=16,
        hidden_size=2048,
        intermediate_size=10944,
    ),
    "deepseek-v3-shape": dict(
        _DEEPSEEK_KV,
        num_layers=61,
        num_attention_heads=128,
        hidden_size=7168,
        intermediate_size=18432,
        q_lora_rank=1536,
    ),
}
MODEL_PRESETS.update(MLA_PRESETS)


class Resolution(NamedTuple):
    """One flag value changed by validation."""

    field: str
    old: Any
    new: Any
    reason: str


def tp_geometry_errors(tp: int, hq: int | None, hkv: int | None, inter: int | None) -> list[str]:
    """What keeps ``tp`` ranks from splitting a model: query heads and MLP width must divide by
    ``tp``; KV heads must divide by it or divide it (replicated). ``None``: not checked."""
    out = []
    if hq is not None and hq % tp:
        out.append(f"tp_size={tp} must divide num_attention_heads={hq}")
    if inter is not None and inter % tp:
        out.append(f"tp_size={tp} must divide intermediate_size={inter}")
    if hkv is not None and hkv % tp and tp % hkv:
        out.append(
            f"tp_size={tp} must divide num_kv_heads={hkv} (heads split) or be a multiple of it "
            "(heads replicated)"
        )
    return out


def _opt(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ServerArgs:
    """Resolved configuration of a prefill server with a hierarchical KV cache; ``resolutions``
    and ``warnings`` record every change validation made."""

    # Model (random weights; geometry from ``model_preset`` unless given explicitly).
    model_preset: str = _opt("tiny", "Model geometry preset.", choices=MODEL_PRESET_CHOICES)
    num_layers: int | None = _opt(None, "Number of transformer layers.", type=int)
    num_attention_heads: int | None = _opt(None, "Number of query heads.", type=int)
    head_num: int | None = _opt(None, "Number of KV heads (the KV pool's H).", type=int)
    head_dim: int | None = _opt(None, "Head dimension (the KV pool's D).", type=int)
    hidden_size: int | None = _opt(None, "Model hidden size.", type=int)
    intermediate_size: int | None = _opt(None, "MLP intermediate size.", type=int)
    vocab_size: int | None = _opt(None, "Vocabulary size.", type=int)
    dtype: str = _opt(
        "auto",
        "Model and KV dtype; auto = bfloat16 on CUDA, float32 on CPU.",
        choices=DTYPE_CHOICES,
    )
    use_mla: bool = _opt(
        False,
        "Multi-head latent attention (DeepSeek's): the model caches one latent per token and "
        "layer in an MLA KV pool (one buffer per layer). The deepseek-* presets need it.",
    )
    kv_lora_rank: int | None = _opt(
        None, "MLA: width of the cached latent (unset: the preset's, else 512).", type=int
    )
    qk_rope_head_dim: int | None = _opt(
        None,
        "MLA: width of the rotary key cached beside the latent (unset: preset's, else 64).",
        type=int,
    )
    qk_nope_head_dim: int | None = _opt(
        None, "MLA: per-head query/key width without rotary (unset: preset's, else 128).", type=int
    )
    v_head_dim: int | None = _opt(
        None, "MLA: per-head value width (unset: the preset's, else 128).", type=int
    )
    q_lora_rank: int | None = _opt(
        None,
        "MLA: rank of the query's low-rank projection; 0 = a full query projection (unset: the "
        "preset's, else 0; DeepSeek-V3: 1536).",
        type=int,
    )
    uses_mamba_radix_cache: bool = _opt(
        False, "The model uses a mamba radix cache (derived from the model in SGLang)."
    )

    # Memory and scheduling.
    page_size: int = _opt(1, "Tokens per KV page.")
    max_total_tokens: int = _opt(16384, "Device KV pool size in tokens.")
    chunked_prefill_size: int = _opt(8192, "Max tokens of one prefill chunk; -1 disables chunking.")
    disable_radix_cache: bool = _opt(False, "Disable prefix caching.")
    max_running_requests: int | None = _opt(
        None,
        "The maximum number of requests holding KV (running, parked or transferring); the "
        "prefill side gets 2x as many metadata buffers. Unset = 2048 (SGLang's floor).",
        type=int,
    )
    device: str = _opt("auto", "Device to run on.", choices=DEVICE_CHOICES)
    random_seed: int = _opt(0, "Seed for weights, workloads and failure injection.")

    # Hierarchical cache (L2 host pool).
    enable_hierarchical_cache: bool = _opt(False, "Enable the L2 host KV cache.")
    hicache_ratio: float = _opt(2.0, "Host pool size as a multiple of the device pool.")
    hicache_size: float = _opt(0.0, "Host pool size in GB; 0 uses --hicache-ratio.")
    hicache_write_policy: str = _opt(
        "write_through", "When KV is backed up to host.", choices=WRITE_POLICY_CHOICES
    )
    hicache_io_backend: str = _opt(
        "kernel",
        "kernel = Triton copy kernels, direct = plain copies of contiguous runs.",
        choices=IO_BACKEND_CHOICES,
    )
    hicache_mem_layout: str = _opt(
        "page_first", "Host pool memory layout.", choices=MEM_LAYOUT_CHOICES
    )
    hicache_storage_backend: str | None = _opt(
        None,
        "L3 storage backend: file (one file per page, SGLang's HiCacheFile), mooncake (a "
        "Mooncake Store shared by every instance on one master; settings in the extra config, "
        "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or MOONCAKE_* variables) or dynamic (a "
        "HiCacheStorage class named by the extra config's backend_name, module_path, "
        "class_name); needs --enable-hierarchical-cache.",
        type=str,
    )
    hicache_storage_backend_extra_config: str | None = _opt(
        None,
        "Settings of the storage backend and its prefetch: a JSON object, or @path to a .json, "
        ".toml or .yaml file (prefetch_threshold, prefetch_timeout_base, "
        "prefetch_timeout_per_ki_token, hicache_storage_pass_prefix_keys; the rest goes to the "
        "backend, e.g. file_storage_path, max_size; Mooncake: master_server_address, "
        "global_segment_size, protocol, ...).",
        type=str,
    )
    hicache_storage_prefetch_policy: str = _opt(
        "timeout",
        "When a request stops waiting for its prefetch from storage: best_effort (never "
        "waits), wait_complete (waits for it), timeout (waits up to prefetch_timeout_base + "
        "prefetch_timeout_per_ki_token per 1024 tokens).",
        choices=PREFETCH_POLICY_CHOICES,
    )
    hicache_host_memory_mode: str = _opt(
        "cache",
        "cache: the host pool is the L2 tier; buffer_only: host memory only stages L3 traffic "
        "(needs a storage backend; write_back resolves to write_through).",
        choices=HOST_MEMORY_MODE_CHOICES,
    )
    served_model_name: str | None = _opt(
        None,
        "The model name in L3 storage keys; unset: the preset, its geometry and the seed (the "
        "random weights), so processes share pages only for the same weights.",
        type=str,
    )
    load_back_threshold: int = _opt(
        10, "Host hits shorter than this many tokens are recomputed instead of loaded back."
    )
    hicache_upstream_chunked_insert: bool = _opt(
        False,
        "Reproduce SGLang: inserts of unfinished (chunked) requests do not count as hits, so long "
        "chunk-prefilled prompts are never backed up under write-through. Off = back them up.",
    )

    # PD disaggregation and optimistic prefill.
    disaggregation_mode: str = _opt(
        "null", "PD disaggregation role.", choices=DISAGGREGATION_MODE_CHOICES
    )
    optimistic_prefill_attempts: int = _opt(
        0, "Optimistic forward passes a request may run before its decode peer is ready; 0 = off."
    )
    disaggregation_transfer_backend: str = _opt(
        "simulated",
        "simulated = the in-process, deterministic decode simulation; mooncake = decode worker "
        "processes, KV written by Mooncake's transfer engine (SGLang's default).",
        choices=TRANSFER_BACKEND_CHOICES,
    )
    disaggregation_bootstrap_port: int = _opt(
        8998, "Bootstrap server port on the prefill server (mooncake backend); 0 = a free port."
    )
    host: str = _opt(
        "127.0.0.1",
        "The host the prefill server's listeners bind (the mooncake backend's bootstrap server, "
        "control socket and transfer engines).",
        type=str,
    )
    disaggregation_decode_allocation_policy: str = _opt(
        "early",
        "When decode reserves a request's KV: early (at bootstrap, SGLang's default) or "
        "prefill_complete (after prefill finished; a prefill server then runs optimistic prefill, "
        "as SGLang 0.5.23). prefill_complete is accepted for validation; the runtime refuses it.",
        choices=DECODE_ALLOCATION_POLICY_CHOICES,
    )
    optimistic_prefill_write_through: bool = _opt(
        False,
        "Keep optimistic prefill under L2 write_through (SGLang 0.5.23's gate). Off = the "
        "earlier gate (optimism only with L2 write_back).",
    )
    pp_size: int = _opt(1, "Pipeline parallel size (accepted for validation; not implemented).")
    tp_size: int = _opt(
        1,
        "Tensor parallel size: ranks that split the attention heads, MLP columns and KV heads; "
        "one process per rank (torchrun).",
    )

    # Failure injection (test hooks, as upstream's tests use).
    disaggregation_force_not_ready_prob: float = _opt(
        0.0, "Per-rid deterministic probability that the peer is not ready at the first attempt."
    )
    disaggregation_bootstrap_failure_prob: float = _opt(
        0.0, "Probability that a decode peer's bootstrap fails."
    )
    disaggregation_transfer_failure_prob: float = _opt(
        0.0, "Probability that a KV transfer to the decode peer fails."
    )

    # Simulated decode peer (this project's PD simulation; not SGLang flags).
    disaggregation_bootstrap_delay: str = _opt(
        "fixed:0", "Bootstrap delay of a decode peer: fixed:S, uniform:LO,HI or exponential:MEAN."
    )
    disaggregation_transfer_latency_s: float = _opt(
        0.0, "Latency of one KV send to the decode peer, seconds."
    )
    disaggregation_transfer_bandwidth_gbps: float = _opt(
        0.0, "Bandwidth of KV sends to the decode peer, GB/s; 0 = unlimited."
    )
    disaggregation_decode_prefix_len: int = _opt(
        0, "Tokens the decode peer already holds (sends start there, page-aligned)."
    )

    # Filled by validation; not flags.
    resolutions: list[Resolution] = field(default_factory=list, init=False, repr=False)
    warnings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._fill_geometry()
        errors = self._validation_errors()
        if errors:
            raise ValueError("invalid server arguments:\n  - " + "\n  - ".join(errors))
        self._handle_decode_allocation_policy()
        self._handle_hicache_layout()
        self._handle_storage_layout()
        self._handle_host_memory_mode()
        self._handle_optimistic_prefill_gate()
        if (
            self.disaggregation_decode_allocation_policy == "prefill_complete"
            and self.disaggregation_mode == "prefill"
            and self.optimistic_prefill_attempts <= 0
        ):
            raise ValueError(PREFILL_COMPLETE_NEEDS_ATTEMPTS)

    # ------------------------------------------------------------------ resolution helpers
    def _resolve(self, name: str, new: Any, reason: str) -> None:
        old = getattr(self, name)
        setattr(self, name, new)
        self.resolutions.append(Resolution(name, old, new, reason))
        self.warnings.append(reason)
        logger.warning("%s (%s: %r -> %r)", reason, name, old, new)

    def _fill_geometry(self) -> None:
        preset = MODEL_PRESETS.get(self.model_preset)
        if preset is None:
            return  # reported by validation
        for name in GEOMETRY_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, preset[name])
        if self.use_mla:
            for name in MLA_FIELDS:
                if getattr(self, name) is None:
                    setattr(self, name, preset.get(name, MLA_DEFAULTS[name]))

    # ------------------------------------------------------------------ validation
    def _validation_errors(self) -> list[str]:
        errors: list[str] = []
        for f in dataclasses.fields(self):
            value, allowed = getattr(self, f.name), f.metadata.get("choices")
            if f.init and isinstance(value, float) and not math.isfinite(value):
                errors.append(f"{_flag(f.name)}={value!r} must be a finite number")
            if allowed is not None and value not in allowed:
                errors.append(f"{_flag(f.name)}={value!r} is not one of {', '.join(allowed)}")
            if f.name.endswith("_prob") and not (
                isinstance(value, (int, float)) and 0.0 <= value <= 1.0
            ):
                errors.append(f"{_flag(f.name)}={value!r} must be a probability in [0, 1]")

        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                errors.append(f"{_flag(name)}={value!r} must be a positive integer")

        def non_negative_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                errors.append(f"{_flag(name)}={value!r} must be an integer >= 0")

        port = self.disaggregation_bootstrap_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            errors.append(
                f"--disaggregation-bootstrap-port={port!r} must be an integer in [0, 65535]"
            )
        if not isinstance(self.host, str) or not self.host:
            errors.append(f"--host={self.host!r} must be a host name or address")

        for name in GEOMETRY_FIELDS:
            positive(name, allow_none=True)
        if (
            isinstance(self.num_attention_heads, int)
            and isinstance(self.head_num, int)
            and self.head_num > 0
            and self.num_attention_heads % self.head_num != 0
        ):
            errors.append(
                f"--num-attention-heads={self.num_attention_heads} must be a multiple of "
                f"--head-num={self.head_num} (grouped-query attention)"
            )
        for name in ("page_size", "max_total_tokens", "pp_size", "tp_size"):
            positive(name)
        errors.extend(self._tp_errors())
        positive("max_running_requests", allow_none=True)
        for name in (
            "load_back_threshold",
            "random_seed",
            "optimistic_prefill_attempts",
            "disaggregation_decode_prefix_len",
        ):
            non_negative_int(name)

        def page_multiple(name: str) -> None:
            value, page = getattr(self, name), self.page_size
            valid_page = isinstance(page, int) and not isinstance(page, bool) and page > 0
            if isinstance(value, int) and valid_page and value % page != 0:
                errors.append(f"{_flag(name)}={value} must be a multiple of --page-size={page}")

        cps = self.chunked_prefill_size
        if isinstance(cps, bool) or not isinstance(cps, int) or (cps < 1 and cps != -1):
            errors.append(f"--chunked-prefill-size={cps!r} must be a positive integer or -1")
        elif cps != -1:
            page_multiple("chunked_prefill_size")
        page_multiple("max_total_tokens")

        if not isinstance(self.hicache_ratio, (int, float)) or self.hicache_ratio <= 0:
            errors.append(f"--hicache-ratio={self.hicache_ratio!r} must be > 0")
        if not isinstance(self.hicache_size, (int, float)) or self.hicache_size < 0:
            errors.append(f"--hicache-size={self.hicache_size!r} must be >= 0 (GB; 0 = use ratio)")
        if self.hicache_storage_backend is not None and (
            not isinstance(self.hicache_storage_backend, str) or not self.hicache_storage_backend
        ):
            errors.append(
                f"--hicache-storage-backend={self.hicache_storage_backend!r} must be a backend "
                "name or unset"
            )
        errors.extend(self._storage_errors())
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            errors.append(
                "--enable-hierarchical-cache and --disable-radix-cache are mutually exclusive"
            )

        if self.use_mla:
            for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
                positive(name)
            non_negative_int("q_lora_rank")
            rope = self.qk_rope_head_dim
            if isinstance(rope, int) and not isinstance(rope, bool) and rope > 0 and rope % 2:
                errors.append(f"--qk-rope-head-dim={rope} must be even (rotary pairs)")
        elif self.model_preset in MLA_PRESETS:
            errors.append(f"--model-preset={self.model_preset} is an MLA model: it needs --use-mla")

        delay = self.disaggregation_bootstrap_delay
        kind, _, params = str(delay).partition(":")
        try:
            values = [float(x) for x in params.split(",")] if params else []
        except ValueError:
            values = []
        arity = {"fixed": 1, "exponential": 1, "uniform": 2}.get(kind)
        if (
            arity is None
            or len(values) != arity
            or any(not math.isfinite(v) or v < 0 for v in values)
            or (kind == "uniform" and values[1] < values[0])
        ):
            errors.append(
                f"--disaggregation-bootstrap-delay={delay!r} must be fixed:S, uniform:LO,HI "
                "(LO <= HI) or exponential:MEAN with finite, non-negative seconds"
            )
        for name in ("disaggregation_transfer_latency_s", "disaggregation_transfer_bandwidth_gbps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                errors.append(f"{_flag(name)}={value!r} must be >= 0")
        return errors

    def _storage_errors(self) -> list[str]:
        """The L3 flags, buffer_only's needs as SGLang's ``validate_hicache_host_memory_mode``."""
        errors = []
        if self.hicache_storage_backend_extra_config is not None:
            try:
                self.storage_extra_config()
            except ValueError as e:
                errors.append(str(e))
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name
        ):
            errors.append(f"--served-model-name={self.served_model_name!r} must be a name")
        if self.enable_hierarchical_cache and self.hicache_host_memory_mode == "buffer_only":
            if self.hicache_storage_backend is None:
                errors.append(
                    "--hicache-host-memory-mode buffer_only requires a storage backend "
                    "(--hicache-storage-backend): host memory only stages L3 traffic"
                )
            if self.disaggregation_mode == "decode":
                errors.append(
                    "--hicache-host-memory-mode buffer_only is not supported with "
                    "--disaggregation-mode decode"
                )
        return errors

    def storage_extra_config(self) -> dict[str, Any]:
        """``--hicache-storage-backend-extra-config`` as a dict (see :func:`parse_extra_config`)."""
        return parse_extra_config(self.hicache_storage_backend_extra_config)

    def storage_model_name(self) -> str:
        """The model part of L3 storage keys: ``--served-model-name``, else the preset with a
        digest of what makes its random weights."""
        if self.served_model_name:
            return self.served_model_name
        import hashlib

        ident = json.dumps(
            [
                self.model_preset,
                self.random_seed,
                self.use_mla,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                *(getattr(self, f) for f in GEOMETRY_FIELDS),
            ]
        )
        digest = hashlib.sha256(ident.encode()).hexdigest()[:12]
        return f"hicache-prefill/{self.model_preset}-{digest}"

    def _tp_errors(self) -> list[str]:
        """An MLA latent is not split; sizes that are not positive ints are checked elsewhere."""
        tp = self.tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 1:
            return []

        def size(v: Any) -> int | None:
            return v if isinstance(v, int) and v > 0 else None

        hkv = None if self.use_mla else size(self.head_num)
        errors = tp_geometry_errors(
            tp, size(self.num_attention_heads), hkv, size(self.intermediate_size)
        )
        return [f"--tp-size: {e}" for e in errors]

    def kv_heads_per_rank(self) -> int:
        """KV heads one tensor-parallel rank's pools hold (1 when heads are replicated)."""
        tp = self.tp_size
        return self.head_num // tp if tp <= self.head_num else 1

    # ------------------------------------------------------------------ resolutions
    def _handle_hicache_layout(self) -> None:
        """As SGLang's ``_handle_hicache``."""
        if self.hicache_mem_layout == "page_first" and self.hicache_io_backend == "direct":
            self._resolve(
                "hicache_mem_layout", "page_first_direct", LAYOUT_PAGE_FIRST_WITH_DIRECT_IO
            )
        if self.hicache_mem_layout == "page_first_direct" and self.hicache_io_backend != "direct":
            self._resolve("hicache_io_backend", "direct", LAYOUT_DIRECT_NEEDS_DIRECT_IO)

    def _handle_storage_layout(self) -> None:
        """As SGLang's ``resolve_storage_layout_compatibility``."""
        if (
            self.hicache_storage_backend in STORAGE_BACKENDS_WITHOUT_LAYER_FIRST
            and self.hicache_mem_layout == "layer_first"
        ):
            new = "page_first_direct" if self.hicache_io_backend == "direct" else "page_first"
            reason = LAYOUT_MOONCAKE_LAYER_FIRST.format(layout=new, io=self.hicache_io_backend)
            self._resolve("hicache_mem_layout", new, reason)

    def _handle_host_memory_mode(self) -> None:
        """buffer_only has no host tier to write back to (``validate_hicache_host_memory_mode``)."""
        if (
            self.enable_hierarchical_cache
            and self.hicache_host_memory_mode == "buffer_only"
            and self.hicache_write_policy == "write_back"
        ):
            self._resolve("hicache_write_policy", "write_through", BUFFER_ONLY_WRITE_BACK)

    def _handle_decode_allocation_policy(self) -> None:
        """SGLang 0.5.23's PD hook: ``prefill_complete`` only where it is supported, and on a
        prefill server with optimistic prefill (attempts 0 -> 1)."""
        if self.disaggregation_decode_allocation_policy != "prefill_complete":
            return
        unsupported = []
        if self.disaggregation_mode not in ("prefill", "decode"):
            unsupported.append("aggregated serving")
        if self.disaggregation_transfer_backend != "mooncake":
            unsupported.append("transfer backends other than Mooncake")
        if self.pp_size != 1:
            unsupported.append("pipeline or attention context parallelism")
        if self.tp_size != 1:
            unsupported.append("attention tensor parallelism greater than one")
        if self.disaggregation_mode == "decode" and self.enable_hierarchical_cache:
            unsupported.append("decode radix cache or decode HiCache")
        if (
            self.disaggregation_mode == "prefill"
            and self.enable_hierarchical_cache
            and (
                self.hicache_storage_backend is not None
                or self.hicache_write_policy != "write_back"
            )
        ):
            unsupported.append("prefill HiCache other than L2 write_back")
        if unsupported:
            raise ValueError(
                "--disaggregation-decode-allocation-policy prefill_complete does not yet support "
                + ", ".join(unsupported)
            )
        if self.disaggregation_mode == "prefill" and self.optimistic_prefill_attempts == 0:
            self._resolve("optimistic_prefill_attempts", 1, PREFILL_COMPLETE_FORCES_ATTEMPTS)

    def _handle_optimistic_prefill_gate(self) -> None:
        """The upstream gate (SGLang 0.5.17's, or 0.5.23's with the write-through flag): the
        first matching rule resolves the attempts to 0."""
        if self.optimistic_prefill_attempts <= 0 or self.disaggregation_mode != "prefill":
            return
        reason = None
        if self.pp_size > 1:
            reason = GATE_PP
        elif self.enable_hierarchical_cache and not self._l2_gate_allows(self.hicache_write_policy):
            gate = self.optimistic_prefill_write_through
            reason = GATE_HICACHE_WRITE_THROUGH if gate else GATE_HICACHE
        if reason is None and self.uses_mamba_radix_cache:
            reason = GATE_MAMBA
        if reason is not None:
            self._resolve("optimistic_prefill_attempts", 0, reason)

    def optimistic_gate_allows(
        self,
        write_policy: str | None,
        storage: bool | None = None,
        host_memory_mode: str | None = None,
    ) -> bool:
        """Whether the gate keeps optimistic attempts for an L2 cache with ``write_policy``
        (``None``: no L2); ``storage`` / ``host_memory_mode`` default to the flags."""
        if self.pp_size > 1 or self.uses_mamba_radix_cache:
            return False
        return write_policy is None or self._l2_gate_allows(write_policy, storage, host_memory_mode)

    def _l2_gate_allows(
        self, write_policy: str, storage: bool | None = None, mode: str | None = None
    ) -> bool:
        """Without storage: ``write_back``, or ``write_through`` under 0.5.23's gate. With storage:
        only 0.5.23's "L3 buffer-only write-through"."""
        storage = self.hicache_storage_backend is not None if storage is None else storage
        mode = self.hicache_host_memory_mode if mode is None else mode
        newer = bool(self.optimistic_prefill_write_through)
        if storage:
            return newer and mode == "buffer_only" and write_policy == "write_through"
        if write_policy == "write_back":
            return True
        return write_policy == "write_through" and newer

    # ------------------------------------------------------------------ runtime helpers
    def unsupported_runtime_features(self) -> list[str]:
        """Features accepted for validation that this prototype cannot run."""
        out = []
        if self.pp_size > 1:
            out.append(f"--pp-size={self.pp_size}: pipeline parallelism is not implemented")
        if self.hicache_storage_backend is not None and not self.enable_hierarchical_cache:
            out.append(
                f"--hicache-storage-backend={self.hicache_storage_backend} needs "
                "--enable-hierarchical-cache (L3 sits below the host tier)"
            )
        if self.uses_mamba_radix_cache:
            out.append("--uses-mamba-radix-cache: mamba models are not implemented")
        if self.disaggregation_decode_allocation_policy == "prefill_complete":
            out.append(
                "--disaggregation-decode-allocation-policy=prefill_complete: decode allocation "
                "after prefill completes is not implemented"
            )
        if self.disable_radix_cache:
            out.append("--disable-radix-cache: the runtime always uses a radix cache")
        if self.disaggregation_transfer_backend == "mooncake" and self.tp_size > 1:
            out.append(
                f"--disaggregation-transfer-backend=mooncake with --tp-size={self.tp_size}: the "
                "Mooncake transport serves one prefill rank"
            )
        return out

    def check_runtime_supported(self) -> None:
        problems = self.unsupported_runtime_features()
        if problems:
            raise ValueError("unsupported configuration:\n  - " + "\n  - ".join(problems))

    def resolved_device(self) -> Any:
        """The ``torch.device`` to run on (``auto`` = CUDA when available, else CPU)."""
        import torch

        if self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available()):
            if not torch.cuda.is_available():
                raise ValueError("--device=cuda but torch sees no CUDA device")
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def torch_dtype(self) -> Any:
        """The model / KV ``torch.dtype`` (``auto`` = bfloat16 on CUDA, float32 on CPU)."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Resolved flags, resolutions and warnings, JSON-serializable."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        out["resolutions"] = [r._asdict() for r in self.resolutions]
        out["warnings"] = list(self.warnings)
        return out

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if not f.init:
                continue
            meta = f.metadata
            help_text = meta.get("help", "")
            if "choices" in meta:
                help_text += f" Choices: {', '.join(meta['choices'])}."
            flag = _flag(f.name)
            if isinstance(f.default, bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            arg_type = meta.get("type") or type(f.default)
            parser.add_argument(
                flag, type=arg_type, default=f.default, help=f"{help_text} Default: {f.default}."
            )

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> ServerArgs:
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        return cls(**{name: getattr(namespace, name) for name in names})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_extra_config(value: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config``: ``None`` or ``""`` -> ``{}``; a dict as is; a
    JSON object; ``@path`` to a ``.json``, ``.toml`` (Python 3.11+) or ``.yaml`` / ``.yml``
    (needs PyYAML) file holding one. ``ValueError`` naming the flag (and the file) otherwise."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"{EXTRA_CONFIG_FLAG} must be a JSON string or @file, got {value!r}")
    if value.startswith("@"):
        source = f"the file {value[1:]!r}"
        parsed = _load_config_file(value[1:], source)
    else:
        source = "the JSON string"
        try:
            parsed = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{EXTRA_CONFIG_FLAG}: {source} is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"{EXTRA_CONFIG_FLAG}: {source} must hold an object, got {type(parsed).__name__}"
        )
    return parsed


def _load_config_file(path: str, source: str) -> Any:
    ext = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if ext not in ("json", "toml", "yaml", "yml"):
        raise ValueError(f"{EXTRA_CONFIG_FLAG}=@{path}: the file must be .json, .toml or .yaml")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{EXTRA_CONFIG_FLAG}=@{path}: cannot read {source}: {e}") from None
    loads: Any = json.loads
    if ext == "toml":
        try:
            import tomllib
        except ImportError:
            raise ValueError(
                f"{EXTRA_CONFIG_FLAG}=@{path}: .toml needs Python 3.11 (tomllib)"
            ) from None
        loads = tomllib.loads
    elif ext in ("yaml", "yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"{EXTRA_CONFIG_FLAG}=@{path}: .yaml needs PyYAML (pip install pyyaml)"
            ) from None
        loads = yaml.safe_load
    try:
        return loads(text)
    except Exception as e:  # noqa: BLE001 - each format's own errors
        raise ValueError(f"{EXTRA_CONFIG_FLAG}: {source} does not parse: {e}") from None


def prepare_server_args(argv: list[str]) -> ServerArgs:
    """Parse ``argv`` (without the program name) into a validated, resolved ``ServerArgs``."""
    parser = argparse.ArgumentParser(prog="server_args.py", description=__doc__.split("\n")[0])
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(args.to_dict(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
