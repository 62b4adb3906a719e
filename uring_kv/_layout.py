"""The caches' layout, worked out once: :class:`CacheLayout`.

It owns the check of the caches a caller passes (one device, dim 0 the row, every row one contiguous
run of its tensor's own bytes) and every number derived from their shapes: bytes per row of each
tensor, where each tensor's bytes sit in a block, a block's bytes, the geometry a persistent index
records. A store builds one from its caches and hands it down (stripes, engines, the remote tier),
so the caches are checked once and the formula for a block's bytes is written here alone. It never
touches a file, a ring or CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class CacheLayout:
    """The caches (a mapping name → tensor, or a sequence of tensors), checked, and their block
    geometry. Every constructor that takes ``caches`` (the engine, the stores, the Mooncake tier)
    also takes a ``CacheLayout``, and a store passes the one it made down to what it builds. It
    holds the tensors (so keeps them alive); ``of`` returns a layout given to it unchanged."""

    names: tuple[str, ...]
    tensors: tuple[Any, ...]
    tensor_block_bytes: tuple[int, ...]  # one row of each tensor, in bytes
    offsets: tuple[int, ...]  # where each tensor's row starts in a block
    block_bytes: int  # one row of every tensor: a block, unpadded

    @classmethod
    def of(cls, caches: Any) -> CacheLayout:
        """The layout of ``caches`` (checked; one-line refusals naming the cache), or ``caches``
        itself when it is one already."""
        if isinstance(caches, CacheLayout):
            return caches
        names, tensors = normalise_caches(caches)
        # Bytes of one row of each tensor, from its shape: stride(0) overstates it for a tensor of
        # one row that is a slice (its stride still spans the whole parent's row).
        sizes = [int(t.numel() // t.shape[0] * t.element_size()) for t in tensors]
        offsets = [sum(sizes[:position]) for position in range(len(sizes))]
        return cls(tuple(names), tuple(tensors), tuple(sizes), tuple(offsets), sum(sizes))

    @property
    def device(self) -> Any:
        """The device every tensor is on."""
        return self.tensors[0].device

    @property
    def gpu(self) -> bool:
        """Whether the caches are CUDA tensors (``after=`` applies only then)."""
        return bool(self.device.type == "cuda")

    @property
    def num_rows(self) -> int:
        """Rows (blocks) of each tensor: dim 0."""
        return int(self.tensors[0].shape[0])

    def geometry(self) -> list[list[Any]]:
        """Each tensor's name, dtype, row shape and row bytes: what a persistent index records."""
        return [[name, str(t.dtype).removeprefix("torch."), list(t.shape[1:]), nbytes]
                for name, t, nbytes in zip(self.names, self.tensors, self.tensor_block_bytes, strict=True)]


def normalise_caches(caches: Any) -> tuple[list[str], list[Any]]:
    import torch

    if isinstance(caches, torch.Tensor):
        raise TypeError("caches must be a mapping name → tensor or a sequence of tensors, not one tensor")
    if isinstance(caches, Mapping):
        names, tensors = [str(k) for k in caches], list(caches.values())
    elif isinstance(caches, Sequence):
        tensors = list(caches)
        names = [str(i) for i in range(len(tensors))]
    else:
        raise TypeError(f"caches must be a mapping or a sequence of tensors, got {type(caches).__name__}")
    if not tensors:
        raise ValueError("caches is empty: at least one tensor is needed")
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"cache {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dim() < 1 or t.shape[0] == 0 or t.numel() == 0:
            raise ValueError(f"cache {name!r} has no blocks (shape {tuple(t.shape)})")
        if not t.is_contiguous():  # (a view whose blocks are not one run each, or overlap: as_strided, a slice
            # of an inner dim, an expanded dim): its block bytes would reach memory it does not own
            raise ValueError(f"cache {name!r} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}): "
                             "each block (dim 0) must be one contiguous run of its own bytes")
        if t.device != tensors[0].device:
            raise ValueError(f"cache {name!r} is on {t.device}, cache {names[0]!r} on {tensors[0].device}: "
                             "all caches must be on one device")
        if t.shape[0] != tensors[0].shape[0]:
            raise ValueError(f"cache {name!r} has {t.shape[0]} blocks, cache {names[0]!r} has "
                             f"{tensors[0].shape[0]}: every cache needs the same number of blocks")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"cache {name!r} is on {t.device}; only CUDA and CPU tensors are supported")
    return names, tensors

