"""Single host slots of a host pool read and written on the CPU, in every layout (the tests'
window into host KV; blocking copies, not the copy path)."""

from __future__ import annotations

import torch

from kernels.ops.checks import slot_indices


class SlotAccess:
    """Mixed into ``_HostKVPoolBase``: reads ``layout``, ``page_size``, ``size``, ``dtype``,
    ``_host_parts``, ``_token_shapes()`` and ``_check_layer``."""

    layout: str
    page_size: int
    size: int
    dtype: torch.dtype
    _host_parts: list[torch.Tensor]

    def _check_slots(self, indices: torch.Tensor) -> torch.Tensor:
        return slot_indices("indices", indices, n_slots=self.size).cpu()

    def _get_slots(self, layer_id: int, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A copy of host slots ``indices`` of a layer from each part, each ``[n, *token]``."""
        idx = self._check_slots(indices)
        return tuple(self._slot_view(part, layer_id, idx) for part in self._host_parts)

    def _set_slots(
        self, layer_id: int, indices: torch.Tensor, values: tuple[torch.Tensor, ...], names: str
    ) -> None:
        """Write one ``[n, *token]`` tensor per part into host slots ``indices`` of a layer."""
        self._check_layer(layer_id)
        idx = self._check_slots(indices)
        want = [(idx.numel(), *tok) for tok in self._token_shapes()]
        if len(values) != len(want) or any(
            tuple(v.shape) != w for v, w in zip(values, want, strict=True)
        ):
            raise ValueError(f"{names} must have shapes {want}")
        for part, value in zip(self._host_parts, values, strict=True):
            self._slot_assign(part, layer_id, idx, value.to(self.dtype).cpu())

    def _slot_view(self, part: torch.Tensor, layer_id: int, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, ...]`` of ``part`` (K, V or the MLA buffer) for ``layer_id``; a copy."""
        self._check_layer(layer_id)
        if self.layout == "layer_first":
            return part[layer_id][idx]
        if self.layout == "page_first":
            return part[idx, layer_id]
        return part[idx // self.page_size, layer_id, idx % self.page_size]

    def _slot_assign(
        self, part: torch.Tensor, layer_id: int, idx: torch.Tensor, value: torch.Tensor
    ) -> None:
        if self.layout == "layer_first":
            part[layer_id][idx] = value
        elif self.layout == "page_first":
            part[idx, layer_id] = value
        else:
            part[idx // self.page_size, layer_id, idx % self.page_size] = value
