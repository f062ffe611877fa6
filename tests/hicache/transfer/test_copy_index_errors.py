"""A bad index the kernel finds on the device reaches the controller's ack as one error naming the
op and the argument (issue 19): the ack is popped as a failed copy (``take_failure`` hands out a
``CopyError`` whose cause is the ``kernels.KVIndexError``), the accounting stays whole, and the
next copies work.

On CPU the host reads every index, so the path is exercised inside
``kernels.ops.checks.device_range_checks()`` (what CUDA does without debug checks); the bug is
injected by a host pool whose copy shifts one index past the end of its buffer.
"""

from __future__ import annotations

import torch

from hicache_prefill import kernels
from hicache_prefill.hicache.transfer.errors import BackupError, LoadBackError
from hicache_prefill.kernels.ops import checks
from tests.hicache.transfer.test_controller import make
from tests.support.kv_content import check_host, write_device


def _corrupt(pool, method: str, position: int) -> None:  # noqa: ANN001
    """Make ``pool.<method>`` pass one index (argument ``position``) past its buffer's end."""
    original = getattr(pool, method)

    def shifted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        args = list(args)
        idx = args[position].clone()
        idx[0] = 10_000
        args[position] = idx
        return original(*args, **kwargs)

    setattr(pool, method, shifted)


def test_a_bad_load_index_is_reported_at_its_ack() -> None:
    c = make(page=1, size=32)
    try:
        host = torch.arange(4, dtype=torch.int64)
        _corrupt(c.host_pool, "load_to_device_per_layer", 2)  # device_indices
        with checks.device_range_checks():
            dev = c.load(host, node_id=7)
            c.start_loading()
            c.load_stream.synchronize()
            assert c.loading_check() == [7]
        failure = c.take_failure(7)
        assert isinstance(failure, LoadBackError) and c.take_failure(7) is None
        e = failure.cause
        assert isinstance(e, kernels.KVIndexError)
        assert (e.op, e.argument, e.slot) == ("transfer_kv_per_layer", "dst_indices", 10_000)
        assert "transfer_kv_per_layer(dst_indices)" in str(failure)
        assert not c.ack_load_queue
        c.check_integrity()
        c.evict_device(dev)
        c.check_integrity()
        # The controller keeps working: a clean load completes without an error.
        del c.host_pool.load_to_device_per_layer
        with checks.device_range_checks():
            c.load(host, node_id=8)
            c.start_loading()
            c.load_stream.synchronize()
            assert c.loading_check() == [8]
        c.check_integrity()
    finally:
        c.close()


def test_a_bad_backup_index_on_a_table_side_is_reported_at_its_ack() -> None:
    """layer_first backups go through ``transfer_kv_all_layer``: both sides pointer tables,
    bounded by the slots recorded with them."""
    c = make(page=1, size=32)
    try:
        d = torch.arange(1, 5, dtype=torch.int64)
        tokens, positions = [5, 6, 7, 8], [0, 1, 2, 3]
        write_device(c.device_pool, d, tokens, positions)
        _corrupt(c.host_pool, "backup_from_device_all_layer", 1)  # host_indices (destination)
        with checks.device_range_checks():
            c.write(d, node_id=3)
            assert c.wait_write() == [3]
        failure = c.take_failure(3)
        assert isinstance(failure, BackupError)
        e = failure.cause
        assert isinstance(e, kernels.KVIndexError)
        assert (e.op, e.argument, e.slot) == ("transfer_kv_all_layer", "dst_indices", 10_000)
        assert e.n_slots == c.host_pool.size
        c.check_integrity()
        del c.host_pool.backup_from_device_all_layer
        with checks.device_range_checks():
            h = c.write(d, node_id=4)
            assert c.wait_write() == [4]
        c.check_integrity()
        assert h is not None
        check_host(c.host_pool, h, tokens, positions)  # the clean backup is exact
    finally:
        c.close()
