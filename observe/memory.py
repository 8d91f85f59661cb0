"""Memory of one rank after the forward pass and at its peak during a training step.

GPU: the caching allocator's ``memory_allocated()`` right after the forward pass and
``max_memory_allocated()`` over the step. CPU, which has no allocator statistics: the bytes of
the parameters, gradients and optimizer state that exist (this rank's shards under FSDP), plus
every storage the forward pass saves for backward (``saved_tensors_hooks``; parameters
excluded); the peak adds the gradients the backward pass creates. Temporaries inside one
operation are not counted; the process's resident high-water mark (VmHWM), logged beside it, is
an upper bound that includes the Python interpreter and libraries.
"""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from observe.logging_utils import Nothing

GiB = 1024**3  # the memory lines' unit (the tutorial's "GB" figures are these too)


def _storage_key(t: torch.Tensor):
    """(address, bytes) of the storage behind ``t``; of this rank's shard for a DTensor (FSDP)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def tensor_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (anything else skipped), each counted once."""
    keys = {_storage_key(t) for t in tensors if torch.is_tensor(t) and t.device.type != "meta"}
    return sum(nbytes for _, nbytes in keys)


def _proc_kib(path: str, field: str) -> int:
    """The number of a ``<field>: <n> kB`` line of a /proc file (Linux); 0 where it is absent."""
    try:
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return 0


def resident_peak_bytes() -> int:
    """VmHWM of this process (Linux), 0 where /proc is absent."""
    return _proc_kib("/proc/self/status", "VmHWM") * 1024


class NullProbe(Nothing):
    """A probe that measures nothing (every step but the measured one)."""

    after_forward = peak = 0


class MemoryProbe:
    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.after_forward = self.peak = 0

    @contextlib.contextmanager
    def step(self):
        """Wrap one whole training step; call ``forward_done()`` right after the forward pass."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        params = {_storage_key(p) for p in self.model.parameters()}
        self._saved = set()  # the storages (address, bytes) saved for backward

        def pack(t):
            if torch.is_tensor(t) and (k := _storage_key(t)) not in params:
                self._saved.add(k)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        grads = tensor_bytes(p for p in self.model.parameters())  # one gradient per parameter
        self.peak = self.after_forward + grads

    def forward_done(self):
        if self.device.type == "cuda":
            self.after_forward = torch.cuda.memory_allocated(self.device)
        else:
            params = list(self.model.parameters())
            state = [v for st in self.optimizer.state.values() for v in st.values()]
            grads = [p.grad for p in params]  # (tensor_bytes skips the None of the ones not made)
            saved = sum(nbytes for _, nbytes in self._saved)
            self.after_forward = tensor_bytes(params + grads + state) + saved

    def method(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda allocator statistics"
        return "a count of parameters, gradients, optimizer state and saved activations"


def available_bytes(device: torch.device, ranks_here: int) -> int:
    """Memory one rank may use: the GPU's; on a CPU the node's MemAvailable shared by its
    ``ranks_here`` ranks (0 where /proc is absent)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return _proc_kib("/proc/meminfo", "MemAvailable") * 1024 // max(1, ranks_here)


def memory_warning(model: torch.nn.Module, sample_shape: tuple, batch: int, device: torch.device,
                   amp_dtype, ranks_here: int) -> str | None:
    """One line when a training step of the unsharded ``model`` is estimated to need more
    memory than this rank has (None otherwise), said before anything is allocated for it."""
    try:
        need = estimated_step_bytes(model, sample_shape, batch, device, amp_dtype)
    except Exception:  # an operation fake tensors cannot run (a custom kernel): no estimate
        return None
    have = available_bytes(device, ranks_here)
    if not have or need <= have:
        return None
    return (f"a training step needs about {need / GiB:.1f} GB a rank (estimated: weights, "
            f"gradients, Adam's moments, activations of {batch} samples), more than the "
            f"{have / GiB:.1f} GB available: lower the local batch (--global_batch_size, more "
            f"ranks) or the image size")


def estimated_step_bytes(model: torch.nn.Module, sample_shape: tuple, batch: int,
                         device: torch.device, amp_dtype) -> int:
    """The bytes one training step of ``model`` (unsharded, not compiled) needs at ``batch``
    samples on ``device``, before anything is allocated there: the forward pass runs on fake
    tensors (shapes, no data), the kernels chosen as on ``device``, and the count is the CPU
    probe's above: parameters, their gradients and Adam's two moments, and what the forward
    pass saves for backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch.compile's fake tensors)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # the model's tensors as fakes on the device (the model itself may be elsewhere)
        params = {name: mode.from_tensor(p).to(device) for name, p in model.named_parameters()}
        buffers = {name: mode.from_tensor(b).to(device) for name, b in model.named_buffers()}
    param_storages = {p.untyped_storage()._cdata for p in params.values()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in param_storages:
            saved[s._cdata] = s.nbytes()
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                           enabled=amp_dtype is not None):
        x = torch.empty(batch, *sample_shape, device=device)
        torch.func.functional_call(model, {**params, **buffers}, (x,))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * weights + sum(saved.values())  # weights, gradients, two moments; activations
