"""Host-device copies that never wait for the device: through pinned host buffers that are allocated
once and reused round-robin.

A copy from pageable memory first waits for the stream (the previous step's work), which would undo
async scheduling; allocating pinned memory per copy goes through the driver's page pinning, which can
stall for milliseconds. A ring buffer is reused only after the copy that last used it has completed (its
CUDA event), which with many buffers and one or two steps in flight is long past.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_TO_TORCH = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}


class PinnedRing:
    """Copies are ordered on the stream that is current when the ring is made (the engine's steps run on
    it): each buffer's event is recorded there, created once and reused (looking up the current stream
    and creating an event cost more host time than the copy's launch)."""

    def __init__(self, device: torch.device, num_buffers: int = 32, initial_bytes: int = 1 << 16):
        self.device = device
        self._cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        if self._cuda:
            self._stream = torch.cuda.current_stream(device)
            self._buffers = [
                torch.empty(initial_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)
            ]
            self._events = [torch.cuda.Event() for _ in range(num_buffers)]
        self._next = 0

    def _take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        # The copy that last used this buffer (normally long finished; returns at once if none has).
        self._events[index].synchronize()
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(
                max(nbytes, 2 * self._buffers[index].numel()), dtype=torch.uint8, pin_memory=True
            )
        return self._buffers[index], index

    def _record(self, index: int) -> None:
        self._events[index].record(self._stream)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device; the call returns before the copy runs."""
        if not self._cuda:
            return torch.from_numpy(np.ascontiguousarray(array))
        dtype = _NUMPY_TO_TORCH[array.dtype]
        nbytes = array.nbytes
        buffer, index = self._take(nbytes)
        host = buffer[:nbytes].view(dtype)
        host.numpy()[...] = array.reshape(-1)
        out = host.to(self.device, non_blocking=True).view(array.shape)
        self._record(index)
        return out

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A host copy of ``tensor`` (a view of a ring buffer, valid until the ring comes round again)
        and the event after which it is filled (None on the CPU: it already is)."""
        if not self._cuda:
            # A copy here too: the tensor may be a buffer that the next step overwrites (a graph's).
            return tensor.clone(), None
        nbytes = tensor.numel() * tensor.element_size()
        buffer, index = self._take(nbytes)
        host = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        self._record(index)
        return host, self._events[index]
