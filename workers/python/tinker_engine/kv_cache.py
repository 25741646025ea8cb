"""The sampler's key/value cache: transformers' DynamicCache with layers that grow in place.

transformers' ``DynamicLayer`` appends each decode step's keys and values with ``torch.cat``, which
copies the whole cached sequence of every layer at every step: a step's cost grows with the cached
length, and a generation of L tokens copies O(L²) per row. At the ~26M-parameter stand-in shape on
a 2-core CPU, 128 rows, a decode step took 93 ms in a 64-token generation and 392 ms in a 512-token
one; with this module's layers 83 and 125 ms (docs/benchmarks.md, "The sampler's key/value cache").

``GrowingLayer`` keeps each layer's keys and values in a buffer with room at the end: a step writes its
token into that room and the layer's ``keys`` / ``values`` are views of the filled part, so a step copies
only its own token. When the room runs out the buffer is replaced by one with ``1 / GROWTH`` more room
(at least ``MIN_ROOM`` positions), so a generation copies its cache a logarithmic number of times, and
the memory held is at most an eighth (or ``MIN_ROOM`` positions) more than the cache's: on a GPU the key/
value cache is most of a sampler's memory, and the engine admits requests by their tokens, not by
what the buffers reserve beyond them.

When rows finish, ``batch_select_indices`` selects the buffers' rows, room included, so the next step
still writes in place. Everything else that touches a layer (the sampler's merge of a joining batch,
sample.py ``_merge_caches``; ``crop``; ``reset``) replaces ``keys`` and ``values`` as transformers
does; the next ``update`` sees that they are no longer its views and moves them into a new buffer. The values a layer returns are the ones ``DynamicLayer`` returns, element for
element (tests/test_kv_cache.py).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer

#: The fewest positions a new buffer has beyond what it must hold.
MIN_ROOM = 64
#: A new buffer's room beyond what it must hold, as a share of that: 1 / GROWTH.
GROWTH = 8


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a buffer with room to grow (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None
        length = keys.shape[-2] if keys.numel() else 0
        end = length + key_states.shape[-2]
        buffers = self._buffers
        if buffers is None or not self._owns() or end > buffers[0].shape[-2]:
            room = max(MIN_ROOM, end // GROWTH)
            kbuf = key_states.new_empty((*key_states.shape[:-2], end + room, key_states.shape[-1]))
            vbuf = value_states.new_empty((*value_states.shape[:-2], end + room, value_states.shape[-1]))
            if length:
                kbuf[..., :length, :].copy_(keys)
                vbuf[..., :length, :].copy_(values)
            buffers = self._buffers = (kbuf, vbuf)
        buffers[0][..., length:end, :].copy_(key_states)
        buffers[1][..., length:end, :].copy_(value_states)
        self.keys, self.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
        self._views = (self.keys, self.values)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Rows kept (the others finished): the buffers' rows are selected, room included, so the next
        step still writes in place (one copy, as DynamicLayer's selection makes)."""
        if self._buffers is None or not self._owns():
            super().batch_select_indices(indices)
            return
        assert self.keys is not None
        length = self.keys.shape[-2]
        kbuf, vbuf = self._buffers[0][indices, ...], self._buffers[1][indices, ...]
        self._buffers = (kbuf, vbuf)
        self.keys, self.values = kbuf[..., :length, :], vbuf[..., :length, :]
        self._views = (self.keys, self.values)

    def _owns(self) -> bool:
        """``keys`` and ``values`` are still the views this layer made (nothing outside replaced them)."""
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def reset(self) -> None:
        self._buffers = self._views = None
        super().reset()


def new_cache(config: PreTrainedConfig) -> DynamicCache:
    """A ``DynamicCache`` for a model of ``config`` whose plain layers are ``GrowingLayer``s (sliding-window
    and other layer kinds are kept as transformers builds them)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def plain_layers(cache: DynamicCache) -> bool:
    """Every layer of ``cache`` a plain growing key/value layer (``DynamicLayer`` or ``GrowingLayer``, not a
    sliding window's): the rows of two such caches can be merged (sample.py ``_merge_caches``)."""
    return all(type(layer) in (DynamicLayer, GrowingLayer) for layer in cache.layers)
