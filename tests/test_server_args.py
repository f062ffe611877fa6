"""ServerArgs: validation, resolutions, the optimistic-prefill gate and the CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import subprocess
import sys
import typing

import pytest

from hicache_prefill.server_args import (
    GATE_HICACHE,
    GATE_HICACHE_WRITE_THROUGH,
    GATE_MAMBA,
    GATE_PP,
    LAYOUT_DIRECT_NEEDS_DIRECT_IO,
    LAYOUT_MOONCAKE_LAYER_FIRST,
    LAYOUT_PAGE_FIRST_WITH_DIRECT_IO,
    Resolution,
    ServerArgs,
    prepare_server_args,
)

PD = dict(disaggregation_mode="prefill", optimistic_prefill_attempts=2)


# ---------------------------------------------------------------- the upstream five-config matrix
@pytest.mark.parametrize(
    "kwargs, attempts, warning",
    [
        pytest.param({}, 2, None, id="no-hicache-kept"),
        pytest.param(
            dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
            2,
            None,
            id="l2-write-back-kept",
        ),
        pytest.param(dict(enable_hierarchical_cache=True), 0, GATE_HICACHE, id="default-wt-off"),
        pytest.param(
            dict(
                enable_hierarchical_cache=True,
                hicache_write_policy="write_back",
                hicache_storage_backend="file",
            ),
            0,
            GATE_HICACHE,
            id="write-back-with-l3-off",
        ),
        pytest.param(dict(pp_size=2), 0, GATE_PP, id="pp2-off"),
    ],
)
def test_upstream_matrix(kwargs, attempts, warning, caplog):
    with caplog.at_level(logging.WARNING, logger="server_args"):
        args = ServerArgs(**PD, **kwargs)
    assert args.optimistic_prefill_attempts == attempts
    if warning is None:
        assert args.resolutions == [] and args.warnings == []
        assert not caplog.records
    else:
        assert args.resolutions == [Resolution("optimistic_prefill_attempts", 2, 0, warning)]
        assert args.warnings == [warning]
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == [warning]


# ---------------------------------------------------------------- the full cross product
# The gate's expected behaviour as a table of (rule, warning), first match wins, written from
# docs/DESIGN.md section 7 rather than from the implementation.
def _policy(c: dict) -> str:
    """The write policy after validation: buffer_only resolves write_back to write_through."""
    if c["hicache"] and c["host_mode"] == "buffer_only" and c["policy"] == "write_back":
        return "write_through"
    return c["policy"]


GATE_TABLE = [
    (lambda c: c["pp_size"] > 1, GATE_PP),
    (
        lambda c: c["hicache"] and (c["storage"] is not None or _policy(c) != "write_back"),
        GATE_HICACHE,
    ),
    (lambda c: c["mamba"], GATE_MAMBA),
]


# With --optimistic-prefill-write-through the hicache rule is SGLang 0.5.23's: L2 write_back and
# write_through with no storage backend keep the attempts, and so does L3 in buffer_only host
# memory under write_through; the pp and mamba rules are unchanged.
def _l3_buffer_only_write_through(c: dict) -> bool:
    return c["host_mode"] == "buffer_only" and _policy(c) == "write_through"


GATE_TABLE_WRITE_THROUGH = [
    (lambda c: c["pp_size"] > 1, GATE_PP),
    (
        lambda c: (
            c["hicache"]
            and (
                (c["storage"] is not None and not _l3_buffer_only_write_through(c))
                or (c["storage"] is None and _policy(c) not in ("write_back", "write_through"))
            )
        ),
        GATE_HICACHE_WRITE_THROUGH,
    ),
    (lambda c: c["mamba"], GATE_MAMBA),
]
GATE_TABLES = {False: GATE_TABLE, True: GATE_TABLE_WRITE_THROUGH}

AXES = dict(
    mode=["null", "prefill", "decode"],
    attempts=[0, 1, 3],
    hicache=[False, True],
    policy=["write_through", "write_through_selective", "write_back"],
    storage=[None, "file"],
    pp_size=[1, 2],
    mamba=[False, True],
    host_mode=["cache", "buffer_only"],
)
CASES = [dict(zip(AXES, values, strict=True)) for values in itertools.product(*AXES.values())]


def _expected(case: dict, write_through_flag: bool) -> tuple[int, str | None]:
    if case["attempts"] == 0 or case["mode"] != "prefill":
        return case["attempts"], None
    for rule, warning in GATE_TABLES[write_through_flag]:
        if rule(case):
            return 0, warning
    return case["attempts"], None


@pytest.mark.parametrize("flag", [False, True], ids=["flag-off", "write-through-flag"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_gate_cross_product(case, flag):
    kwargs = dict(
        disaggregation_mode=case["mode"],
        optimistic_prefill_attempts=case["attempts"],
        optimistic_prefill_write_through=flag,
        enable_hierarchical_cache=case["hicache"],
        hicache_write_policy=case["policy"],
        hicache_storage_backend=case["storage"],
        pp_size=case["pp_size"],
        uses_mamba_radix_cache=case["mamba"],
        hicache_host_memory_mode=case["host_mode"],
    )
    if (
        case["hicache"]
        and case["host_mode"] == "buffer_only"
        and (case["storage"] is None or case["mode"] == "decode")
    ):  # SGLang's validate_hicache_host_memory_mode refuses these
        with pytest.raises(ValueError, match="--hicache-host-memory-mode buffer_only"):
            ServerArgs(**kwargs)
        return
    args = ServerArgs(**kwargs)
    attempts, warning = _expected(case, flag)
    assert args.optimistic_prefill_attempts == attempts
    assert args.hicache_write_policy == _policy(case)
    gate = [r for r in args.resolutions if r.field == "optimistic_prefill_attempts"]
    if warning is None:
        assert gate == []
    else:
        assert gate == [Resolution("optimistic_prefill_attempts", case["attempts"], 0, warning)]
        assert args.warnings.count(warning) == 1
    # The executor's build-time question agrees with the resolution for every L2 policy.
    if case["mode"] == "prefill" and case["attempts"] > 0:
        policy = args.hicache_write_policy if case["hicache"] else None
        assert args.optimistic_gate_allows(policy) == (attempts > 0)


@pytest.mark.parametrize(
    "policy, flag, kept",
    [
        ("write_back", False, True),
        ("write_through", False, False),
        ("write_through_selective", False, False),
        ("write_back", True, True),
        ("write_through", True, True),
        ("write_through_selective", True, False),
    ],
)
def test_optimistic_gate_allows_reads_the_fields_as_they_are_now(policy, flag, kept):
    args = ServerArgs(**PD)
    assert args.optimistic_gate_allows(None)
    args.optimistic_prefill_write_through = flag
    assert args.optimistic_gate_allows(policy) is kept
    args.hicache_storage_backend = "file"
    assert not args.optimistic_gate_allows(policy)


def test_write_through_flag_on_the_cli(caplog):
    argv = ["--disaggregation-mode", "prefill", "--optimistic-prefill-attempts", "2",
            "--enable-hierarchical-cache"]  # fmt: skip
    assert prepare_server_args(argv).optimistic_prefill_attempts == 0
    on = prepare_server_args([*argv, "--optimistic-prefill-write-through"])
    assert on.optimistic_prefill_attempts == 2 and on.optimistic_prefill_write_through
    assert on.resolutions == []
    selective = prepare_server_args(
        [*argv, "--optimistic-prefill-write-through", "--hicache-write-policy",
         "write_through_selective"]
    )  # fmt: skip
    assert selective.optimistic_prefill_attempts == 0
    assert selective.warnings == [GATE_HICACHE_WRITE_THROUGH]


def test_max_running_requests_is_validated():
    assert ServerArgs().max_running_requests is None
    assert ServerArgs(max_running_requests=3).max_running_requests == 3
    with pytest.raises(ValueError, match="--max-running-requests=0 must be a positive integer"):
        ServerArgs(max_running_requests=0)
    assert prepare_server_args(["--max-running-requests", "7"]).max_running_requests == 7


def test_gate_never_raises_and_is_stable_under_replace():
    args = ServerArgs(enable_hierarchical_cache=True, **PD)
    again = dataclasses.replace(args)
    # The resolved value is what every reader uses; a rebuilt copy records no second change.
    assert again.optimistic_prefill_attempts == 0 and again.resolutions == []


# ---------------------------------------------------------------- layout / io resolutions
def test_page_first_direct_with_kernel_resolves_io_backend(caplog):
    with caplog.at_level(logging.WARNING, logger="server_args"):
        args = ServerArgs(hicache_mem_layout="page_first_direct", hicache_io_backend="kernel")
    assert args.hicache_io_backend == "direct"
    assert args.resolutions == [
        Resolution("hicache_io_backend", "kernel", "direct", LAYOUT_DIRECT_NEEDS_DIRECT_IO)
    ]
    assert len(caplog.records) == 1


def test_page_first_with_direct_resolves_layout():
    args = ServerArgs(hicache_mem_layout="page_first", hicache_io_backend="direct")
    assert args.hicache_mem_layout == "page_first_direct"
    assert args.hicache_io_backend == "direct"
    assert args.resolutions == [
        Resolution(
            "hicache_mem_layout",
            "page_first",
            "page_first_direct",
            LAYOUT_PAGE_FIRST_WITH_DIRECT_IO,
        )
    ]


@pytest.mark.parametrize(
    "layout, io", [("layer_first", "kernel"), ("layer_first", "direct"), ("page_first", "kernel")]
)
def test_compatible_layouts_untouched(layout, io):
    args = ServerArgs(hicache_mem_layout=layout, hicache_io_backend=io)
    assert (args.hicache_mem_layout, args.hicache_io_backend) == (layout, io)
    assert args.resolutions == []


@pytest.mark.parametrize("io, layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_mooncake_resolves_layer_first_as_sglang_does(io, layout):
    args = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                      hicache_mem_layout="layer_first", hicache_io_backend=io)  # fmt: skip
    reason = LAYOUT_MOONCAKE_LAYER_FIRST.format(layout=layout, io=io)
    assert args.resolutions == [Resolution("hicache_mem_layout", "layer_first", layout, reason)]
    file = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file",
                      hicache_mem_layout="layer_first", hicache_io_backend=io)  # fmt: skip
    assert file.hicache_mem_layout == "layer_first" and file.resolutions == []


# ---------------------------------------------------------------- defaults and geometry
def test_defaults_match_sglang():
    args = ServerArgs()
    assert args.page_size == 1
    assert args.enable_hierarchical_cache is False
    assert args.hicache_ratio == 2.0 and args.hicache_size == 0
    assert args.hicache_write_policy == "write_through"
    assert args.hicache_io_backend == "kernel"
    assert args.hicache_mem_layout == "page_first"
    assert args.hicache_storage_backend is None
    assert args.disaggregation_mode == "null"
    assert args.optimistic_prefill_attempts == 0
    assert args.pp_size == 1 and args.load_back_threshold == 10


def test_preset_fills_geometry_and_explicit_fields_win():
    args = ServerArgs(model_preset="llama3-8b-shape", num_layers=2)
    assert (args.num_layers, args.head_num, args.head_dim) == (2, 8, 128)
    assert args.num_attention_heads == 32


def test_runtime_refuses_unimplemented_features():
    ServerArgs().check_runtime_supported()
    args = ServerArgs(pp_size=2, hicache_storage_backend="file", uses_mamba_radix_cache=True)
    with pytest.raises(ValueError) as err:
        args.check_runtime_supported()
    for flag in ("--pp-size=2", "--hicache-storage-backend=file", "--uses-mamba-radix-cache"):
        assert flag in str(err.value)


def test_transfer_backend_flags():
    args = ServerArgs()
    assert args.disaggregation_transfer_backend == "simulated"  # SGLang's default is mooncake
    assert (args.disaggregation_bootstrap_port, args.host) == (8998, "127.0.0.1")  # SGLang's
    cli = prepare_server_args(["--disaggregation-transfer-backend", "mooncake",
                               "--disaggregation-bootstrap-port", "0"])  # fmt: skip
    assert cli.disaggregation_transfer_backend == "mooncake"
    assert cli.disaggregation_bootstrap_port == 0
    cli.check_runtime_supported()
    tp = ServerArgs(disaggregation_transfer_backend="mooncake", tp_size=2)
    with pytest.raises(ValueError, match="transfer-backend=mooncake with --tp-size=2"):
        tp.check_runtime_supported()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(hicache_write_policy="write_around"), "--hicache-write-policy='write_around' is not"),
        (
            dict(hicache_io_backend="cuda"),
            "--hicache-io-backend='cuda' is not one of kernel, direct",
        ),
        (dict(hicache_mem_layout="x"), "--hicache-mem-layout='x' is not one of layer_first"),
        (dict(disaggregation_mode="both"), "--disaggregation-mode='both' is not one of null"),
        (dict(device="tpu"), "--device='tpu' is not one of auto, cuda, cpu"),
        (dict(dtype="int8"), "--dtype='int8' is not one of"),
        (dict(model_preset="gpt5"), "--model-preset='gpt5' is not one of"),
        (dict(page_size=0), "--page-size=0 must be a positive integer"),
        (dict(max_total_tokens=-5), "--max-total-tokens=-5 must be a positive integer"),
        (dict(max_total_tokens=100, page_size=16), "--max-total-tokens=100 must be a multiple"),
        (dict(chunked_prefill_size=0), "--chunked-prefill-size=0 must be a positive integer or -1"),
        (
            dict(chunked_prefill_size=24, page_size=16),
            "--chunked-prefill-size=24 must be a multiple",
        ),
        (dict(hicache_ratio=0), "--hicache-ratio=0 must be > 0"),
        (dict(hicache_ratio=-1.5), "--hicache-ratio=-1.5 must be > 0"),
        (dict(hicache_size=-1), "--hicache-size=-1 must be >= 0"),
        (
            dict(optimistic_prefill_attempts=-1),
            "--optimistic-prefill-attempts=-1 must be an integer",
        ),
        (dict(pp_size=0), "--pp-size=0 must be a positive integer"),
        (dict(tp_size=0), "--tp-size=0 must be a positive integer"),
        (dict(tp_size=3), "--tp-size: tp_size=3 must divide num_attention_heads=4"),
        (
            dict(tp_size=4, num_attention_heads=12, head_num=6),
            "--tp-size: tp_size=4 must divide num_kv_heads=6 (heads split) or be a multiple",
        ),
        (dict(tp_size=4, intermediate_size=130), "--tp-size: tp_size=4 must divide intermediate"),
        (dict(load_back_threshold=-2), "--load-back-threshold=-2 must be an integer >= 0"),
        (dict(num_layers=0), "--num-layers=0 must be a positive integer"),
        (dict(num_attention_heads=6, head_num=4), "--num-attention-heads=6 must be a multiple"),
        (dict(use_mla=True, kv_lora_rank=0), "--kv-lora-rank=0 must be a positive integer"),
        (dict(use_mla=True, qk_rope_head_dim=63), "--qk-rope-head-dim=63 must be even"),
        (dict(use_mla=True, v_head_dim=-1), "--v-head-dim=-1 must be a positive integer"),
        (dict(use_mla=True, q_lora_rank=-1), "--q-lora-rank=-1 must be an integer >= 0"),
        (
            dict(model_preset="deepseek-v2-lite-shape"),
            "--model-preset=deepseek-v2-lite-shape is an MLA model: it needs --use-mla",
        ),
        (
            dict(enable_hierarchical_cache=True, disable_radix_cache=True),
            "--enable-hierarchical-cache and --disable-radix-cache are mutually exclusive",
        ),
        (dict(hicache_storage_backend=""), "--hicache-storage-backend='' must be a backend name"),
        (
            dict(disaggregation_bootstrap_delay="uniform:0.5,0.1"),
            "--disaggregation-bootstrap-delay='uniform:0.5,0.1' must be fixed:S",
        ),
        (
            dict(disaggregation_bootstrap_delay="gaussian:1"),
            "--disaggregation-bootstrap-delay='gaussian:1' must be",
        ),
        (
            dict(disaggregation_transfer_latency_s=-1.0),
            "--disaggregation-transfer-latency-s=-1.0 must be >= 0",
        ),
        (
            dict(disaggregation_decode_prefix_len=-4),
            "--disaggregation-decode-prefix-len=-4 must be an integer >= 0",
        ),
        (
            dict(disaggregation_transfer_failure_prob=1.5),
            "--disaggregation-transfer-failure-prob=1.5 must be a probability",
        ),
        (
            dict(disaggregation_transfer_backend="nixl"),
            "--disaggregation-transfer-backend='nixl' is not one of simulated, mooncake",
        ),
        (
            dict(disaggregation_bootstrap_port=70000),
            "--disaggregation-bootstrap-port=70000 must be an integer in [0, 65535]",
        ),
        (dict(host=""), "--host='' must be a host name or address"),
    ],
)
def test_bad_input_names_flag_and_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        ServerArgs(**kwargs)
    assert message in str(err.value)


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as err:
        ServerArgs(page_size=0, hicache_ratio=0, hicache_write_policy="bad")
    text = str(err.value)
    assert "--page-size" in text and "--hicache-ratio" in text and "--hicache-write-policy" in text


def test_mla_with_dims_is_valid():
    args = ServerArgs(use_mla=True, kv_lora_rank=256, qk_rope_head_dim=32)
    assert (args.kv_lora_rank, args.qk_rope_head_dim) == (256, 32)
    assert (args.qk_nope_head_dim, args.v_head_dim, args.q_lora_rank) == (128, 128, 0)


def test_mla_defaults_are_deepseeks_latent_and_presets_fill_the_rest():
    plain = ServerArgs(use_mla=True)
    assert (plain.kv_lora_rank, plain.qk_rope_head_dim) == (512, 64)  # DeepSeek's latent
    assert (plain.num_layers, plain.num_attention_heads) == (4, 4)  # the tiny preset's
    assert ServerArgs().kv_lora_rank is None  # untouched without --use-mla
    v2 = ServerArgs(model_preset="deepseek-v2-lite-shape", use_mla=True)
    assert (v2.num_layers, v2.num_attention_heads, v2.hidden_size, v2.q_lora_rank) == (
        27, 16, 2048, 0)  # fmt: skip
    v3 = ServerArgs(model_preset="deepseek-v3-shape", use_mla=True, q_lora_rank=0)
    assert (v3.num_layers, v3.num_attention_heads, v3.hidden_size) == (61, 128, 7168)
    assert v3.q_lora_rank == 0  # an explicit value wins over the preset's 1536
    assert ServerArgs(model_preset="deepseek-v3-shape", use_mla=True).q_lora_rank == 1536
    # MLA under tensor parallelism: the latent is whole on every rank, no KV-head condition.
    assert ServerArgs(use_mla=True, tp_size=4, head_num=3, num_attention_heads=12,
                      intermediate_size=128).tp_size == 4  # fmt: skip


# ---------------------------------------------------------------- CLI
def test_cli_defaults_are_the_dataclass_defaults():
    assert prepare_server_args([]).to_dict() == ServerArgs().to_dict()


def test_cli_round_trip_equals_constructor():
    argv = [
        "--enable-hierarchical-cache",
        "--hicache-write-policy",
        "write_back",
        "--hicache-mem-layout",
        "layer_first",
        "--hicache-ratio",
        "3.5",
        "--page-size",
        "16",
        "--max-total-tokens",
        "4096",
        "--chunked-prefill-size",
        "-1",
        "--disaggregation-mode",
        "prefill",
        "--optimistic-prefill-attempts",
        "2",
        "--hicache-storage-backend",
        "file",
    ]
    from_cli = prepare_server_args(argv)
    direct = ServerArgs(
        enable_hierarchical_cache=True,
        hicache_write_policy="write_back",
        hicache_mem_layout="layer_first",
        hicache_ratio=3.5,
        page_size=16,
        max_total_tokens=4096,
        chunked_prefill_size=-1,
        disaggregation_mode="prefill",
        optimistic_prefill_attempts=2,
        hicache_storage_backend="file",
    )
    assert from_cli.to_dict() == direct.to_dict()
    assert from_cli.optimistic_prefill_attempts == 0  # L3 set: gated


def test_cli_bad_value_raises_same_error_as_constructor():
    with pytest.raises(ValueError, match="--page-size=0"):
        prepare_server_args(["--page-size", "0"])


def _run_cli(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "server_args.py", *flags],
        capture_output=True,
        text=True,
        cwd=__import__("os").path.dirname(__import__("os").path.dirname(__file__)),
        timeout=60,
    )


def test_cli_main_prints_resolved_json_and_gate():
    flags = [
        "--enable-hierarchical-cache",
        "--disaggregation-mode",
        "prefill",
        "--optimistic-prefill-attempts",
        "2",
    ]
    gated = _run_cli(*flags)
    assert gated.returncode == 0, gated.stderr
    out = json.loads(gated.stdout)
    assert out["optimistic_prefill_attempts"] == 0
    assert out["warnings"] == [GATE_HICACHE]
    assert out["resolutions"][0]["old"] == 2

    kept = _run_cli(*flags, "--hicache-write-policy", "write_back")
    assert kept.returncode == 0, kept.stderr
    out = json.loads(kept.stdout)
    assert out["optimistic_prefill_attempts"] == 2 and out["warnings"] == []


def test_cli_main_bad_flags_exit_nonzero_with_stderr():
    bad = _run_cli("--hicache-ratio", "0")
    assert bad.returncode != 0
    assert "--hicache-ratio=0.0 must be > 0" in bad.stderr and bad.stdout == ""
    unknown = _run_cli("--no-such-flag")
    assert unknown.returncode != 0 and "--no-such-flag" in unknown.stderr


def test_tp_size_splits_or_replicates_kv_heads():
    """The KV heads one rank's pools hold (the same arithmetic as ``TPShard.plan``, whose
    messages the validation repeats)."""
    assert ServerArgs().tp_size == 1
    assert ServerArgs(tp_size=2).kv_heads_per_rank() == 1  # tiny: 2 KV heads, split
    assert ServerArgs(tp_size=4).kv_heads_per_rank() == 1  # replicated on 2 ranks each
    big = ServerArgs(model_preset="llama3-8b-shape", tp_size=2)
    assert big.kv_heads_per_rank() == 4
    assert ServerArgs(model_preset="llama3-8b-shape", tp_size=8).kv_heads_per_rank() == 1
    args = prepare_server_args(["--tp-size", "2"])
    assert args.tp_size == 2 and args.to_dict()["tp_size"] == 2


# ---------------------------------------------------------------- L3 storage flags
def test_storage_flags_have_sglangs_names_and_defaults():
    args = ServerArgs()
    assert args.hicache_storage_prefetch_policy == "timeout"
    assert args.hicache_host_memory_mode == "cache"
    assert args.hicache_storage_backend_extra_config is None and args.storage_extra_config() == {}
    argv = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-prefetch-policy", "best_effort", "--hicache-host-memory-mode",
            "buffer_only", "--hicache-storage-backend-extra-config",
            '{"max_size": "1G"}']  # fmt: skip
    args = prepare_server_args(argv)
    assert args.hicache_storage_prefetch_policy == "best_effort"
    assert args.storage_extra_config() == {"max_size": "1G"}
    args.check_runtime_supported()  # a backend that exists runs


def test_extra_config_reads_json_toml_and_yaml_files(tmp_path):
    (tmp_path / "c.json").write_text('{"prefetch_threshold": 64}')
    (tmp_path / "c.toml").write_text('prefetch_threshold = 64\nfile_storage_path = "/x"\n')
    for name, want in (
        ("c.json", {"prefetch_threshold": 64}),
        ("c.toml", {"prefetch_threshold": 64, "file_storage_path": "/x"}),
    ):
        args = ServerArgs(hicache_storage_backend_extra_config=f"@{tmp_path / name}")
        assert args.storage_extra_config() == want  # fmt: skip
    (tmp_path / "c.yaml").write_text("prefetch_threshold: 64\n")
    try:
        import yaml  # noqa: F401

        args = ServerArgs(hicache_storage_backend_extra_config=f"@{tmp_path / 'c.yaml'}")
        assert args.storage_extra_config() == {"prefetch_threshold": 64}
    except ImportError:
        with pytest.raises(ValueError, match="PyYAML"):
            ServerArgs(hicache_storage_backend_extra_config=f"@{tmp_path / 'c.yaml'}")


@pytest.mark.parametrize(
    "value, message",
    [
        ("{bad", "is not valid JSON"),
        ("[1, 2]", "must hold an object, got list"),
        ("@/no/such.json", "cannot read"),
        ("@conf.ini", "must be .json, .toml or .yaml"),
    ],
)
def test_bad_extra_config_names_the_flag(value, message):
    with pytest.raises(ValueError, match=message) as err:
        ServerArgs(hicache_storage_backend_extra_config=value)
    assert "--hicache-storage-backend-extra-config" in str(err.value)


def test_buffer_only_needs_storage_and_a_prefill_or_plain_server(caplog):
    with pytest.raises(ValueError, match="requires a storage backend"):
        ServerArgs(enable_hierarchical_cache=True, hicache_host_memory_mode="buffer_only")
    with pytest.raises(ValueError, match="not supported with --disaggregation-mode decode"):
        ServerArgs(enable_hierarchical_cache=True, hicache_host_memory_mode="buffer_only",
                   hicache_storage_backend="file", disaggregation_mode="decode")  # fmt: skip
    args = ServerArgs(enable_hierarchical_cache=True, hicache_host_memory_mode="buffer_only",
                      hicache_storage_backend="file",
                      hicache_write_policy="write_back")  # fmt: skip
    assert args.hicache_write_policy == "write_through"
    assert args.resolutions[0].field == "hicache_write_policy"


def test_storage_model_name_follows_the_weights():
    a, b = ServerArgs(), ServerArgs(random_seed=1)
    assert a.storage_model_name() != b.storage_model_name()
    assert a.storage_model_name() == ServerArgs().storage_model_name()
    assert ServerArgs(served_model_name="Qwen/Qwen3-8B").storage_model_name() == "Qwen/Qwen3-8B"


# ---------------------------------------------------------------- non-finite floats, sizes, alloc
FLOAT_FIELDS = [
    f.name
    for f in dataclasses.fields(ServerArgs)
    if f.init and typing.get_type_hints(ServerArgs)[f.name] in (float, float | None)
]
NON_FINITE = ["nan", "inf", "-inf"]


def test_float_fields_are_found():
    assert {"hicache_ratio", "hicache_size", "disaggregation_transfer_latency_s"} <= set(
        FLOAT_FIELDS
    )


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_float_flags_refuse_non_finite_values(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag}={value} must be a finite number"):
        prepare_server_args([f"{flag}={value}"])  # "-inf" alone reads as a flag
    with pytest.raises(ValueError, match=f"{flag}={value} must be a finite number"):
        ServerArgs(**{name: float(value)})


@pytest.mark.parametrize("delay", ["fixed:nan", "uniform:0,inf", "exponential:inf"])
def test_bootstrap_delay_refuses_non_finite_seconds(delay):
    with pytest.raises(ValueError, match="--disaggregation-bootstrap-delay"):
        prepare_server_args(["--disaggregation-bootstrap-delay", delay])


def test_cli_main_refuses_nan_instead_of_printing_it(capsys):
    from hicache_prefill.server_args import main

    assert main(["--hicache-ratio", "nan"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "--hicache-ratio=nan" in out.err


def test_device_pool_larger_than_the_device_is_refused_with_the_flag(monkeypatch):
    from hicache_prefill.hicache.builder import build_kv_cache
    from hicache_prefill.hicache.memory import host_ram

    with pytest.raises(ValueError, match="--max-total-tokens=1000000000000"):
        build_kv_cache(ServerArgs(device="cpu", max_total_tokens=10**12))

    # 16384 tokens x 4 layers x 2 heads x 16 dims x (K, V) x 4 bytes = 16 MiB > 1 MiB free.
    monkeypatch.setattr(host_ram, "host_memory_available_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match="--max-total-tokens=16384"):
        build_kv_cache(ServerArgs(device="cpu"))
    monkeypatch.setattr(host_ram, "host_memory_available_bytes", lambda: 2**30)
    cache = build_kv_cache(ServerArgs(device="cpu"))
    cache.check_integrity()
    cache.close()


@pytest.mark.parametrize("need", [4.0, True, "4"])
def test_alloc_refuses_a_non_integer_size_and_changes_nothing(need):
    from hicache_prefill.hicache.memory.allocator import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    with pytest.raises(ValueError, match="need_size"):
        alloc.alloc(need)
    assert alloc.available_size() == 64 and alloc.alloc(4).numel() == 4


# ---------------------------------------------------------------- prefill_complete (SGLang 0.5.23)
PREFILL_COMPLETE = dict(
    disaggregation_decode_allocation_policy="prefill_complete",
    disaggregation_transfer_backend="mooncake",
)


def test_prefill_complete_turns_optimistic_prefill_on_for_a_prefill_server() -> None:
    args = ServerArgs(disaggregation_mode="prefill", **PREFILL_COMPLETE)
    assert args.optimistic_prefill_attempts == 1
    assert [r.field for r in args.resolutions] == ["optimistic_prefill_attempts"]
    kept = ServerArgs(
        disaggregation_mode="prefill", optimistic_prefill_attempts=3, **PREFILL_COMPLETE
    )
    assert kept.optimistic_prefill_attempts == 3
    decode = ServerArgs(disaggregation_mode="decode", **PREFILL_COMPLETE)
    assert decode.optimistic_prefill_attempts == 0


@pytest.mark.parametrize(
    "extra,unsupported",
    [
        (dict(disaggregation_mode="null"), "aggregated serving"),
        (
            dict(disaggregation_mode="prefill", disaggregation_transfer_backend="simulated"),
            "transfer backends other than Mooncake",
        ),
        (dict(disaggregation_mode="prefill", pp_size=2), "pipeline"),
        (dict(disaggregation_mode="prefill", tp_size=2), "attention tensor parallelism"),
        (dict(disaggregation_mode="decode", enable_hierarchical_cache=True), "decode HiCache"),
        (
            dict(
                disaggregation_mode="prefill",
                enable_hierarchical_cache=True,
                hicache_write_policy="write_through",
            ),
            "prefill HiCache other than L2 write_back",
        ),
    ],
)
def test_prefill_complete_refuses_what_sglang_refuses(extra: dict, unsupported: str) -> None:
    with pytest.raises(ValueError, match="prefill_complete does not yet support .*" + unsupported):
        ServerArgs(**{**PREFILL_COMPLETE, **extra})


def test_prefill_complete_refused_when_the_gate_turns_optimism_off() -> None:
    with pytest.raises(ValueError, match="prefill_complete requires optimistic prefill"):
        ServerArgs(disaggregation_mode="prefill", uses_mamba_radix_cache=True, **PREFILL_COMPLETE)


def test_prefill_complete_is_validation_only_at_runtime() -> None:
    args = ServerArgs(disaggregation_mode="prefill", **PREFILL_COMPLETE)
    with pytest.raises(ValueError, match="decode allocation after prefill completes"):
        args.check_runtime_supported()
    assert (
        ServerArgs(disaggregation_mode="prefill").disaggregation_decode_allocation_policy == "early"
    )
