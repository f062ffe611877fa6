"""Run SGLang's own optimistic-prefill gate and this project's on the full flag cross product.

SGLang's gate is called as SGLang's code, unmodified, on a minimal object holding the fields it
reads (every field the function reads outside the gate is set to SGLang's "not used" value):

- 0.5.14 / 0.5.17: ``ServerArgs._handle_other_validations`` (a method of the 8000-line
  ``server_args.py``, whose module imports the whole runtime). The method's own source is taken
  from the installed file with ``ast`` and compiled under that file name, with the module globals
  it reads: ``logger``, ``json``, ``Backend`` (unused here) and the real ``resolved_view`` from
  ``sglang.srt.arg_groups.overrides``.
- 0.5.23: the module function ``sglang.srt.arg_groups.serving_hook.handle_other_validations``,
  imported, with its real ``declare_resolution`` / ``resolving_view`` bookkeeping, after
  SGLang's own ``hicache_hook.validate_hicache_host_memory_mode`` (which runs before it in
  SGLang's pipeline: it refuses ``buffer_only`` without a storage backend or on a decode
  server, and resolves its ``write_back`` to ``write_through``). A row both refuse is equal.
  0.5.23 rows also cross ``--disaggregation-decode-allocation-policy`` (``early``,
  ``prefill_complete``) and run SGLang's ``handle_pd_disaggregation`` first, as its pipeline
  does (the ``prefill_complete`` support check, then attempts 0 -> 1 on a prefill server; the
  gate then refuses a prefill server whose attempts it zeroed).

Each row compares SGLang's resolved ``optimistic_prefill_attempts`` with this project's
``ServerArgs(...)`` resolution, and each difference is classified by :func:`classify`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import itertools
import json
import logging
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

AXES: dict[str, tuple] = {
    "disaggregation_mode": ("null", "prefill", "decode"),
    "optimistic_prefill_attempts": (0, 1, 2),
    "pp_size": (1, 2),
    "enable_hierarchical_cache": (False, True),
    "hicache_write_policy": ("write_through", "write_through_selective", "write_back"),
    "hicache_storage_backend": (None, "file"),
    "uses_mamba_radix_cache": (False, True),
}
HOST_MEMORY_MODES = ("cache", "buffer_only")  # 0.5.23 only
DECODE_ALLOCATION_POLICIES = ("early", "prefill_complete")  # 0.5.23 only

# Fields the SGLang gate functions read besides the axes, at their "not in use" values.
_QUIET_FIELDS: dict[str, Any] = {
    "debug_tensor_dump_output_folder": None,
    "msprobe_dump_config": None,
    "limit_mm_data_per_request": None,
    "preferred_sampling_params": None,
    "skip_tokenizer_init": False,
    "default_chat_template_kwargs": None,
    "disaggregation_decode_allocation_policy": "early",
    # read by 0.5.23's PD hook (``handle_pd_disaggregation``, ``_validate_prefill_complete``)
    "disaggregation_transfer_backend": "mooncake",
    "dcp_size": 1,
    "attn_cp_size": 1,
    "tp_size": 1,
    "dp_size": 1,
    "enable_dp_attention": False,
    "enable_pdmux": False,
    "decoupled_spec_role": "null",
    "enable_pd_role_switch": False,
    "encoder_only": False,
    "language_only": False,
    "enable_hisparse": False,
    "disaggregation_decode_enable_radix_cache": False,
    "disaggregation_decode_host_receive_threshold": 1.0,
    "disaggregation_decode_extra_slots": 0,
    "max_running_requests": None,
    "cuda_graph_config": None,
    "skip_server_warmup": False,
    "hicache_size": 0,
    "hicache_ratio": 2.0,
}
REFUSED = -1  # the row is refused at startup (a ValueError)


def _method_from_source(path: str, class_name: str, method: str, env: dict) -> Callable:
    """Compile one method of ``class_name`` from the installed file, as written, in ``env``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    module = ast.Module(body=[item], type_ignores=[])
                    namespace = dict(env)
                    exec(compile(module, path, "exec"), namespace)  # noqa: S102
                    return namespace[method]
    raise LookupError(f"{class_name}.{method} not found in {path}")


def load_gate(version: str) -> tuple[str, Callable[[Any], int]]:
    """SGLang's gate for ``version``: ``(where, run)``, ``run(obj) -> resolved attempts``."""
    hook_spec = importlib.util.find_spec("sglang.srt.arg_groups.serving_hook")
    has_hook = (
        hook_spec is not None
        and "def handle_other_validations(" in open(hook_spec.origin, encoding="utf-8").read()
    )
    if has_hook:
        fn = importlib.import_module("sglang.srt.arg_groups.serving_hook").handle_other_validations
        from sglang.srt.arg_groups.model_override_base import resolving_view

        def run_hook(obj: Any) -> int:
            fn(obj)
            return resolving_view(obj).optimistic_prefill_attempts

        return "sglang.srt.arg_groups.serving_hook.handle_other_validations", run_hook

    spec = importlib.util.find_spec("sglang.srt.server_args")
    overrides = importlib.import_module("sglang.srt.arg_groups.overrides")
    env = {
        "__name__": "sglang.srt.server_args",
        "logger": logging.getLogger("sglang.srt.server_args"),
        "json": json,
        "resolved_view": overrides.resolved_view,
        "Backend": types.SimpleNamespace(DISABLED="disabled"),
    }
    method = _method_from_source(spec.origin, "ServerArgs", "_handle_other_validations", env)

    def run_method(obj: Any) -> int:
        method(obj)
        return obj.optimistic_prefill_attempts

    return "sglang.srt.server_args.ServerArgs._handle_other_validations", run_method


def project_attempts(row: dict[str, Any], write_through_flag: bool | None) -> int:
    """This project's resolved attempts for ``row`` (``write_through_flag`` None: flag absent)."""
    from hicache_prefill import server_args as sa

    kwargs = {k: row[k] for k in AXES}
    if "disaggregation_decode_allocation_policy" in row:
        kwargs["disaggregation_decode_allocation_policy"] = row[
            "disaggregation_decode_allocation_policy"
        ]
        kwargs["disaggregation_transfer_backend"] = "mooncake"
    if "hicache_host_memory_mode" in row and "hicache_host_memory_mode" in {
        f.name for f in dataclasses.fields(sa.ServerArgs)
    }:
        kwargs["hicache_host_memory_mode"] = row["hicache_host_memory_mode"]
    if write_through_flag is not None:
        kwargs["optimistic_prefill_write_through"] = write_through_flag
    try:
        return sa.ServerArgs(**kwargs).optimistic_prefill_attempts
    except ValueError:
        return REFUSED


def _sglang_validate_host_memory_mode() -> Callable[[Any], None] | None:
    """0.5.23's ``validate_hicache_host_memory_mode`` (``None`` where it does not exist)."""
    spec = importlib.util.find_spec("sglang.srt.arg_groups.hicache_hook")
    if spec is None:
        return None
    hook = importlib.import_module("sglang.srt.arg_groups.hicache_hook")
    return getattr(hook, "validate_hicache_host_memory_mode", None)


def _sglang_pd_hook() -> Callable[[Any], None] | None:
    """0.5.23's ``handle_pd_disaggregation`` (``prefill_complete``: its support check, then
    attempts 0 -> 1 on a prefill server); ``None`` where it does not exist."""
    name = "sglang.srt.arg_groups.pd_disaggregation_hook"
    if importlib.util.find_spec(name) is None:
        return None
    return getattr(importlib.import_module(name), "handle_pd_disaggregation", None)


def project_has_write_through_flag() -> bool:
    from hicache_prefill import server_args as sa

    return "optimistic_prefill_write_through" in {f.name for f in dataclasses.fields(sa.ServerArgs)}


def classify(row: dict[str, Any], sglang: int, project: int, version: str, flag: bool) -> str:
    """Why SGLang's and the project's resolutions differ, or ``"UNEXPLAINED"`` (a bug here).

    The project's flag ``--optimistic-prefill-write-through`` selects which SGLang gate it follows:
    off, the 0.5.17 gate; on, the 0.5.23 gate. Documented divergences (docs/SGLANG_FORK.md,
    "Deliberate differences"):

    - ``write_through_flag_on`` (0.5.17 rows, flag on): the project keeps attempts under L2
      write_through with no storage backend, as 0.5.23 does; 0.5.17 resolves 0.
    - ``write_through_flag_off`` (0.5.23 rows, flag off): the reverse.
    - ``mamba`` (0.5.23): 0.5.23 dropped the mamba clause; the project keeps it (mamba models are
      refused at runtime anyway). Under ``prefill_complete`` the project therefore refuses the
      row (the clause zeroes the attempts it needs) where SGLang keeps them.
    - ``l3_buffer_only_flag_off`` (0.5.23 rows, flag off): 0.5.23 keeps attempts with an L3
      backend in ``buffer_only`` host mode under write_through; the project's earlier gate
      (flag off) refuses every storage backend. With the flag the project resolves as 0.5.23.
    """
    if (
        row.get("disaggregation_decode_allocation_policy") == "prefill_complete"
        and row["uses_mamba_radix_cache"]
        and sglang > 0
        and project == REFUSED
    ):
        return "mamba"  # the project's mamba clause zeroes the attempts prefill_complete needs
    live = (
        row["disaggregation_mode"] == "prefill"
        and row["optimistic_prefill_attempts"] > 0
        and row["pp_size"] == 1
    )
    if not live:
        return "UNEXPLAINED"
    hier = row["enable_hierarchical_cache"]
    storage = row["hicache_storage_backend"]
    policy = row["hicache_write_policy"]
    wt_l2 = hier and storage is None and policy == "write_through"
    newer = version.startswith("0.5.23")
    if not newer:
        if flag and wt_l2 and sglang == 0 and project > 0 and not row["uses_mamba_radix_cache"]:
            return "write_through_flag_on"
        return "UNEXPLAINED"
    if sglang > 0 and project == 0:
        if (
            hier and storage is not None and not flag
            and row.get("hicache_host_memory_mode") == "buffer_only"
        ):  # fmt: skip
            return "l3_buffer_only_flag_off"
        if wt_l2 and not flag and not row["uses_mamba_radix_cache"]:
            return "write_through_flag_off"
        if row["uses_mamba_radix_cache"]:
            return "mamba"
    return "UNEXPLAINED"


def _only_mamba_differs(row: dict[str, Any], sglang: int, version: str, flag: bool | None) -> bool:
    """The same row without a mamba model resolves as SGLang does, or differs from SGLang only
    by another documented divergence: the mamba clause alone explains the difference."""
    plain = {**row, "uses_mamba_radix_cache": False}
    ours = project_attempts(plain, flag)
    if ours == sglang:
        return True
    return classify(plain, sglang, ours, version, bool(flag)) not in ("UNEXPLAINED", "mamba")


def run(version: str) -> dict[str, Any]:
    """The whole cross product for the installed SGLang ``version``."""
    for name in ("sglang", "hicache_prefill.server_args"):  # one warning per resolved row
        logging.getLogger(name).setLevel(logging.ERROR)
    where, gate = load_gate(version)
    newer = version.startswith("0.5.23")
    modes = HOST_MEMORY_MODES if newer else (None,)
    policies = DECODE_ALLOCATION_POLICIES if newer else (None,)
    validate = _sglang_validate_host_memory_mode() if newer else None
    pd_hook = _sglang_pd_hook() if newer else None
    flags: tuple[bool | None, ...] = (False, True) if project_has_write_through_flag() else (None,)
    rows, diffs = 0, []
    counts: dict[str, int] = {}
    names = [*AXES, "hicache_host_memory_mode", "disaggregation_decode_allocation_policy"]
    for values in itertools.product(*AXES.values(), modes, policies):
        row = {k: v for k, v in zip(names, values, strict=True) if v is not None or k in AXES}
        obj = types.SimpleNamespace(**{**_QUIET_FIELDS, **row})
        try:
            if pd_hook is not None:  # SGLang's pipeline: the PD hook, the HiCache hook, the gate
                pd_hook(obj)
            if validate is not None and row["enable_hierarchical_cache"]:
                validate(obj)
            sglang_value = gate(obj)
        except ValueError:
            sglang_value = REFUSED
        for flag in flags:
            rows += 1
            ours = project_attempts(row, flag)
            if ours == sglang_value:
                continue
            why = classify(row, sglang_value, ours, version, bool(flag))
            if why == "mamba" and not _only_mamba_differs(row, sglang_value, version, flag):
                why = "UNEXPLAINED"
            counts[why] = counts.get(why, 0) + 1
            diffs.append({**row, "write_through_flag": flag, "sglang": sglang_value,
                          "project": ours, "class": why})  # fmt: skip
    return {
        "gate": where,
        "rows": rows,
        "project_write_through_flag": flags != (None,),
        "differences": counts,
        "unexplained": [d for d in diffs if d["class"] == "UNEXPLAINED"],
        "examples": {c: next(d for d in diffs if d["class"] == c) for c in counts},
        "ok": "UNEXPLAINED" not in counts,
    }
