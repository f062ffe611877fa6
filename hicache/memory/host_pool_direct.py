"""The ``direct`` io backend's copies of a host pool (layer_first or page_first_direct), the same
for MHA and MLA: ``kernels.transfer_kv_direct`` and the page_first_direct ops over a list of
per-layer device buffers per part (K and V, or the MLA latent). Copies only queue work on the
current stream; they never synchronize."""

from __future__ import annotations

import torch

import kernels


class DirectCopies:
    """Mixed into ``_HostKVPoolBase``: reads ``layout``, ``layer_num``, ``page_size`` and the
    part buffers ``_host_parts``."""

    layout: str
    layer_num: int
    page_size: int
    _host_parts: list[torch.Tensor]

    def _backup_direct(
        self,
        device_parts: list[list[torch.Tensor]],
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
    ) -> None:
        """D2H, all layers, every part; ``device_parts``: per part, the per-layer device views."""
        src = [b for part in device_parts for b in part]
        if self.layout == "layer_first":
            kernels.transfer_kv_direct(
                src,
                [hp[i] for hp in self._host_parts for i in range(self.layer_num)],
                device_indices,
                host_indices,
                self.page_size,
            )
        else:  # page_first_direct
            kernels.transfer_kv_all_layer_direct_lf_pf(
                src, list(self._host_parts), device_indices, host_indices, self.page_size
            )

    def _load_direct(
        self,
        device_parts: list[torch.Tensor],
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
    ) -> None:
        """H2D of one layer, every part; ``device_parts``: that layer's view of each part."""
        if self.layout == "layer_first":
            kernels.transfer_kv_direct(
                [hp[layer_id] for hp in self._host_parts],
                device_parts,
                host_indices,
                device_indices,
                self.page_size,
            )
        else:  # page_first_direct
            kernels.transfer_kv_per_layer_direct_pf_lf(
                list(self._host_parts),
                device_parts,
                host_indices,
                device_indices,
                layer_id,
                self.page_size,
            )
