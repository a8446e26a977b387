"""CPU torch tensors that live in the emulated GPU's memory, for tests of the torch
integrations' own kernel path (plans, launches) on the CPU emulator.

EmulatedTorch(fake, monkeypatch) makes, for the test's duration:
- torch.empty(..., device=<a CPU device>) and a CPU tensor's new_empty(...) allocate in the
  emulator's global memory (a torch view of the allocation's bytes), and to_device(t) copy t there with t's strides (a
  transposed view stays transposed, as the kernels see transformers' tensors);
- Tensor.data_ptr() answer the emulated device address of such a tensor (its offset kept),
  and is_cuda / get_device(), torch's raw current stream (0) and the device capability
  (9, 0) say CUDA device 0, as ptxattn's torch paths read them.
So the same tensors are what the kernels read and write (the emulator's memory) and what the
test reads back (the CPU view of those bytes). A tensor torch allocated itself (the result of
an op: a copy, a difference of offsets, a gathered table) has no such home: its data_ptr() is
a mirror, a fresh emulated copy of its storage's bytes as they are at that moment (refreshed
at every data_ptr()), which a kernel may read; a kernel's writes into a mirror are not seen
by the tensor, so a test whose kernel writes one fails rather than passes.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ptxattn import tensors


class EmulatedTorch:
    def __init__(self, fake, monkeypatch):
        self.fake = fake
        self.regions: list[tuple[int, int, int]] = []       # (host start, host end, device)
        T = torch.Tensor
        real_data_ptr = T.data_ptr
        real_empty = torch.empty
        regions = self.regions

        mirrors: dict[tuple[int, int], int] = {}
        self.mirrors = mirrors

        def data_ptr(t):
            host = real_data_ptr(t)
            for start, end, device in regions:
                if start <= host < end:
                    return device + (host - start)
            storage = t.untyped_storage()
            base, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes:
                return host
            device = mirrors.get((base, nbytes))
            if device is None:
                device = mirrors[(base, nbytes)] = self.fake.gmem.alloc(nbytes, "mirror")
            self.fake.gmem.write_bytes(device, ctypes.string_at(base, nbytes))
            return device + (host - base)

        def empty(*size, dtype=None, device=None, **kw):
            if device is None or torch.device(device).type != "cpu" or kw:
                return real_empty(*size, dtype=dtype, device=device, **kw)
            if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
                size = tuple(size[0])
            return self.empty(tuple(int(n) for n in size), dtype or torch.float32)

        real_new_empty = T.new_empty

        def new_empty(t, *size, dtype=None, **kw):
            # a CUDA tensor's new_empty allocates on its device: here, the emulator's memory
            if t.device.type != "cpu" or kw:
                return real_new_empty(t, *size, dtype=dtype, **kw)
            if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
                size = tuple(size[0])
            return self.empty(tuple(int(n) for n in size), dtype or t.dtype)

        monkeypatch.setattr(T, "data_ptr", data_ptr)
        monkeypatch.setattr(T, "new_empty", new_empty)
        monkeypatch.setattr(T, "is_cuda", property(lambda t: True), raising=False)
        monkeypatch.setattr(T, "get_device", lambda t: 0)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0,
                            raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(tensors, "_TORCH", None)           # the stream getter read afresh
        self._real_data_ptr = real_data_ptr

    def empty(self, shape: tuple, dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` in emulated memory (poisoned: all bytes 0xFF)."""
        itemsize = torch.tensor([], dtype=dtype).element_size()
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * itemsize, 1)
        base = self.fake.gmem.alloc(nbytes, "torch")
        alloc = self.fake.gmem.find(base)
        raw = torch.from_numpy(alloc.data[:-(-nbytes // itemsize) * itemsize])
        host = self._real_data_ptr(raw)
        self.regions.append((host, host + alloc.data.nbytes, base))
        return raw.view(dtype)[:int(np.prod(shape, dtype=np.int64))].view(shape)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in emulated memory with t's strides (its memory order kept)."""
        order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))   # outermost first
        dense = t.permute(order).contiguous()
        dev = self.empty(tuple(dense.shape), t.dtype)
        dev.copy_(dense)
        inverse = [order.index(d) for d in range(t.dim())]
        return dev.permute(inverse)
