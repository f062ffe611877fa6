"""Several prefill instances over one real Mooncake Store: each instance is a node of processes
(``tests.support.node_process``, one per TP rank, its own device and host pools, Mooncake
clients bound to loopback by the shim) and every master is started on loopback by the project's
launcher and stopped by its pid.

- B serves requests whose prefix A computed: B's hit pages come from the store, byte for byte
  A's KV (one SHA-256 per page), and within fp32 tolerance of a full recompute, at TP 1, TP 2
  (each rank its own shard) and MLA written by A's rank 0 only, read by a TP 1 instance;
- optimistic prefill (``buffer_only`` + ``write_through``) with bootstrap failures stores no page
  of an attempt that was not finalized: ``speculative_l3_pages`` is 0 on A, and B finds none of
  the aborted requests' pages while it finds every page of the finalized ones;
- a writer killed by SIGKILL in the middle of its puts leaves no page that reads back wrong;
- the master stopped mid-run turns into counted storage failures (calls skipped on
  ``health_check``) while A keeps serving from L1/L2; a master back on the address resumes the
  service (new pages stored and hit; the old ones are gone);
- a full segment is a counted -200 per page, never a wrong page;
- a wrong master address, no master, a segment below Mooncake's minimum: one startup error
  naming the setting;
- nothing listens beyond loopback.

Two TP 2 nodes (A, B) serve the whole module; TP 1 executors live on their rank 0. Each test uses
its own prompts (object names do not carry the TP size, so two TP sizes of one model must not
write the same pages: operators give each its own ``extra_backend_tag``).
"""

from __future__ import annotations

import json
import random
import time

import pytest

from tests.prefill.executor_helpers import BASE_ARGS, prompt
from tests.support.harness import KV_ATOL
from tests.support.loopback import non_loopback, tcp_listeners
from tests.support.mooncake import needs_mooncake
from tests.support.mooncake_master import MooncakeMaster, free_port
from tests.support.node_process import NodeError, StoreNode, stop_nodes

pytestmark = needs_mooncake

NODE_ENV = {
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # a setup against a wrong address: one try ...
    "MC_RPC_TIMEOUT_MS": "3000",  # ... of 3 s (Mooncake's default: 20 tries of 30 s)
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "2",
    "MC_TCP_STATUS_TIMEOUT_SEC": "2",
}
MLA = dict(use_mla=True, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=16)  # fmt: skip


def mc_args(master: MooncakeMaster, extra: dict | None = None, **kw) -> dict:
    """``ServerArgs`` fields of an instance over ``master``'s store (32 MiB segment per rank)."""
    store = {"master_server_address": master.address, "protocol": "tcp",
             "local_hostname": "127.0.0.1", "global_segment_size": "64mb",
             "prefetch_threshold": 8, **(extra or {})}  # fmt: skip
    fields = dict(BASE_ARGS, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                  hicache_storage_backend_extra_config=json.dumps(store), load_back_threshold=4,
                  hicache_storage_prefetch_policy="wait_complete",
                  optimistic_prefill_attempts=0)  # fmt: skip
    fields.update(kw)
    return fields


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster.start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def nodes():
    a = StoreNode(2, env=NODE_ENV, name="A", connect=False)
    b = StoreNode(2, env=NODE_ENV, name="B", connect=False)
    try:
        a.connect()
        b.connect()
        yield a, b
    finally:
        stop_nodes([a, b])


def _ok(results: list[dict]) -> None:
    for r in results:
        assert r["outcome"] == "success", r
        assert r["kv_error"] <= KV_ATOL, r  # equal to a full recompute (fp32 tolerance)


def _share(a: StoreNode, b: StoreNode, name: str, prompts: list[list[int]]) -> tuple[list, list]:
    """A serves ``prompts``; B serves each with a 6-token suffix. Per rank: (A's, B's) replies."""
    ra = a.command("serve", name=name, requests=[[f"a{i}", p] for i, p in enumerate(prompts)])
    rb = b.command("serve", name=name, requests=[[f"b{i}", p + prompt(6, seed=900 + i)]
                                                 for i, p in enumerate(prompts)])  # fmt: skip
    return ra, rb


def _check_shared(ra: dict, rb: dict, prompts: list[list[int]], page: int = 4) -> None:
    _ok(ra["results"])
    _ok(rb["results"])
    for p, x, y in zip(prompts, ra["results"], rb["results"], strict=True):
        n = len(p) // page * page
        assert (y["device"], y["host"], y["storage"], y["computed"]) == (0, n, n, len(p) + 6 - n)
        assert y["decode_prefix_len"] == x["decode_prefix_len"] == 0
        assert y["pages"][: n // page] == x["pages"][: n // page]  # A's bytes, page by page
    assert rb["backend"]["errors"] == {} and rb["backend"]["pages_read_failed"] == 0


def test_b_serves_the_pages_a_computed_and_nothing_listens_beyond_loopback(master, nodes):
    a, b = nodes
    prompts = [prompt(64, seed=1), prompt(48, seed=2), prompt(40, seed=3)]
    a.command("build", name="t1", args=mc_args(master))
    b.command("build", name="t1", args=mc_args(master))
    ra, rb = _share(a, b, "t1", prompts)
    _check_shared(ra[0], rb[0], prompts)
    assert ra[1] is None and rb[1] is None  # TP 1: rank 0 only
    assert ra[0]["backend"]["pages_stored"] == (64 + 48 + 40) // 4
    assert rb[0]["cache"]["storage_hit_tokens"] == 64 + 48 + 40
    listeners = tcp_listeners(a.pids + b.pids + [master.pid])
    assert len(listeners) >= 2 * 2 + 2  # each client's two engine listeners, the master's two
    assert non_loopback(listeners) == []


def test_tp2_instances_share_each_ranks_shard(master, nodes):
    a, b = nodes
    prompts = [prompt(56, seed=11), prompt(32, seed=12)]
    args = mc_args(master, tp_size=2)
    heads = [r["kv_heads"] for r in a.command("build", name="t2", args=args)]
    b.command("build", name="t2", args=args)
    assert heads == [[0, 1], [1, 2]]
    ra, rb = _share(a, b, "t2", prompts)
    for rank in (0, 1):
        _check_shared(ra[rank], rb[rank], prompts)
        assert ra[rank]["backend"]["objects_written"] == 2 * (56 + 32) // 4  # its own K and V
    assert ra[0]["results"][0]["pages"] != ra[1]["results"][0]["pages"]  # two different shards


def test_mla_pages_written_by_rank_0_are_read_by_a_tp1_instance(master, nodes):
    a, b = nodes
    prompts = [prompt(48, seed=21)]
    name = {"served_model_name": "mla-shared"}  # one model, two TP sizes, one MLA object
    a.command("build", name="mla", args=mc_args(master, tp_size=2, **MLA, **name))
    b.command("build", name="mla", args=mc_args(master, **MLA, **name))
    ra, rb = _share(a, b, "mla", prompts)
    _check_shared(ra[0], rb[0], prompts)
    assert ra[0]["backend"]["objects_written"] == 48 // 4
    assert ra[1]["backend"]["objects_written"] == 0  # rank 1 writes nothing
    assert ra[1]["results"][0]["pages"] == ra[0]["results"][0]["pages"]  # the whole latent


def test_optimistic_prefill_stores_no_page_of_an_attempt_that_was_not_finalized(master, nodes):
    a, b = nodes
    opt = mc_args(master, hicache_host_memory_mode="buffer_only",
                  hicache_write_policy="write_through", optimistic_prefill_attempts=2,
                  optimistic_prefill_write_through=True, max_running_requests=2,
                  disaggregation_bootstrap_delay="uniform:0,0.05",
                  disaggregation_force_not_ready_prob=0.5,
                  disaggregation_bootstrap_failure_prob=0.3)  # fmt: skip
    a.command("build", name="opt", args=opt)
    b.command("build", name="opt-reader", args=mc_args(master))
    prompts = [prompt(16 + 4 * (i % 5), seed=300 + i) for i in range(14)]
    ra = a.first("serve", name="opt", requests=[[f"r{i}", p] for i, p in enumerate(prompts)])
    stats = ra["stats"]
    assert stats["speculative_l3_pages"] == 0 and stats["speculative_l2_pages"] == 0
    assert stats["bootstrap_failures"] > 0 and stats["optimistic_admissions"] > 0
    assert ra["storage"]["backup_tokens"] > 0
    outcome = {r["rid"]: r["outcome"] for r in ra["results"]}
    found = b.first("exists", name="opt-reader", prompts=prompts)
    aborted = [i for i in range(len(prompts)) if outcome[f"r{i}"] == "aborted"]
    done = [i for i in range(len(prompts)) if outcome[f"r{i}"] == "success"]
    assert aborted and done
    assert [found[i] for i in aborted] == [0] * len(aborted)  # never stored
    assert [found[i] for i in done] == [len(prompts[i]) // 4 for i in done]  # every page


def test_a_writer_killed_during_its_puts_leaves_no_page_that_reads_back_wrong(master, nodes):
    _, b = nodes
    seg = {"master_server_address": master.address, "protocol": "tcp",
           "local_hostname": "127.0.0.1"}  # fmt: skip
    b.first("store_open", name="reader", extra={**seg, "global_segment_size": "64mb"})
    writers = [StoreNode(1, env=NODE_ENV, module="tests.support.node_stores", name=f"W{i}",
                         connect=False) for i in range(2)]  # fmt: skip
    rng = random.Random(5)
    try:
        for i, w in enumerate(writers):  # segment 0: its objects live in the others' segments
            w.first("store_open", name="w", extra={**seg, "global_segment_size": 0})
            w.first("store_put", name="w", start=i * 100_000, count=8, loop=True)
        ends = []
        for i, w in enumerate(writers):
            while (w.first("store_stats", name="w")["progress"] or 0) < i * 100_000 + 64:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.2))
            w.kill()  # SIGKILL mid-loop: almost always inside batch_put_from
            ends.append(i * 100_000 + 10_000)
    finally:
        stop_nodes(writers)
    for i, end in enumerate(ends):
        got = b.first("store_check", name="reader", start=i * 100_000, count=end - i * 100_000,
                      until_gap=True)  # fmt: skip
        assert got["bad"] == 0, got
        assert got["ok"] >= 64, got
    b.command("store_close", name="reader")


def test_a_master_stopped_mid_run_costs_storage_not_service(nodes):
    a, _ = nodes
    m = MooncakeMaster.start()
    try:
        a.command("build", name="down", args=mc_args(m, hicache_ratio=4.0))
        r1 = [prompt(32, seed=40 + i) for i in range(3)]
        first = a.first("serve", name="down", requests=[[f"x{i}", p] for i, p in enumerate(r1)])
        _ok(first["results"])
        stored = first["backend"]["pages_stored"]
        assert stored == 3 * 8 and first["storage"]["backup_failed_ops"] == 0
        m.stop()
        a.first("wait_health", name="down", healthy=False)
        r2 = [prompt(24, seed=50 + i) for i in range(3)]
        reqs = [[f"y{i}", p + [7]] for i, p in enumerate(r1)] + [
            [f"z{i}", p] for i, p in enumerate(r2)]  # fmt: skip
        down = a.first("serve", name="down", requests=reqs)
        _ok(down["results"])
        hits = {r["rid"]: r["device"] + r["host"] for r in down["results"]}
        assert all(hits[f"y{i}"] == 32 for i in range(3))  # served from L1/L2
        assert down["backend"]["skipped_unhealthy"] > 0  # calls skipped, not waited for
        assert down["backend"]["pages_stored"] == stored
        assert down["storage"]["backup_failed_ops"] > 0  # counted
        m = m.restart()  # same address, empty
        a.first("wait_health", name="down", healthy=True)
        r3 = [prompt(28, seed=60 + i) for i in range(2)]
        back = a.first("serve", name="down", requests=[[f"u{i}", p] for i, p in enumerate(r3)])
        _ok(back["results"])
        assert back["backend"]["pages_stored"] == stored + 2 * 7  # service resumed
        assert a.first("evict", name="down")["host_free"] is True  # no host page leaked
        again = a.first("serve", name="down", requests=[[f"v{i}", p + [3]] for i, p in
                                                        enumerate(r3 + r1[:1])])  # fmt: skip
        _ok(again["results"])
        storage = {r["rid"]: r["storage"] for r in again["results"]}
        assert storage == {"v0": 28, "v1": 28, "v2": 0}  # r1's pages left with the old master
    finally:
        try:
            a.command("close", name="down")
        finally:
            m.stop()


def test_a_full_segment_is_a_counted_failure_never_a_wrong_page(nodes):
    _, b = nodes
    m = MooncakeMaster.start(flags=["--eviction_ratio=0", "--eviction_high_watermark_ratio=1.0"])
    try:
        extra = {"master_server_address": m.address, "protocol": "tcp",
                 "local_hostname": "127.0.0.1", "global_segment_size": "16mb"}  # fmt: skip
        info = b.first("store_open", name="full", extra=extra)
        n = 2 * (16 << 20) // info["page_bytes"]  # twice what the only segment holds (the
        # master evicts nothing: a full segment stays full)
        put = b.first("store_put", name="full", start=0, count=n)
        assert 0 < sum(put) < n
        stats = b.first("store_stats", name="full")["backend"]
        assert stats["errors"].get("-200 NO_AVAILABLE_HANDLE", 0) >= n - sum(put) > 0
        got = b.first("store_check", name="full", start=0, count=n)
        assert got["bad"] == 0 and 0 < got["ok"] <= sum(put)
    finally:
        try:
            b.command("store_close", name="full")
        finally:
            m.stop()


def test_startup_errors_name_the_setting(master, nodes):
    _, b = nodes
    cases = [
        (
            {"master_server_address": f"127.0.0.1:{master.metrics_port}"},  # an HTTP server
            "setup failed.*'master_server_address'",
        ),
        ({"master_server_address": f"127.0.0.1:{free_port()}"}, "no Mooncake master answers"),
        ({"global_segment_size": "8mb"}, "'global_segment_size'.*minimum segment"),
    ]
    for extra, match in cases:
        with pytest.raises(NodeError, match=match):
            b.command("build", name="bad", args=mc_args(master, extra))
    b.command("build", name="good", args=mc_args(master))  # the node is fine afterwards
    b.command("close", name="good")
