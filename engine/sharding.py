"""How a model, its batches and its state are split over the ranks of one model replica:
``Unsharded``, ``RowBandSharding`` (tp/cp ViT: bands of image rows), ``FullyShardedSharding``
(``fsdp``). State maps to the serial layout keyed by parameter name: it loads on any layout.
"""
from __future__ import annotations

import inspect

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

try:  # FSDP2: public from torch 2.6; torch 2.5 (the floor) has the same API under _composable
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401
except ImportError:  # pragma: no cover (torch 2.5)
    from torch.distributed._composable.fsdp import (  # noqa: F401
        FSDPModule, MixedPrecisionPolicy, fully_shard)

from distributed.layers import (reduce_replicated_grad_shards, replicated_grads_comm_hook,
                               tensors_from_serial, tensors_to_serial)
from distributed.parallelize import sharded_loss
from engine.optimizer import load_optimizer_state


class Unsharded:
    """The whole model on every rank of the replica (a replica of one rank)."""

    writes_shards = False  # checkpoints: one file in the serial layout, written by rank 0

    def __init__(self, task):
        self.task = task

    def local_batch(self, x, y):  # this rank's part of a whole batch
        return x, y

    def loss(self, pred, y):  # per sample, of this rank's output
        return self.task.loss(pred, y)

    def whole_output(self, pred):  # for validation metrics and pictures
        return pred

    def register_grad_hooks(self, ddp_model):
        """Gradient reductions beyond DDP's data-parallel average (none here)."""

    def reduce_replicated_grads(self, model):
        """Gradient sums left after the backward passes (none here)."""

    def to_serial(self, model, name: str, t: torch.Tensor, keep: bool = True):
        """``t``, like this rank's parameter ``name``, in the serial layout, copied to host memory
        (collective but here); ``keep`` false: None, on a rank that only takes part in it."""
        whole = self.whole(model, name, t.detach())
        return _to_host(whole) if keep else None

    def whole(self, model, name, t):
        return t

    def from_serial(self, model, name: str, t: torch.Tensor) -> torch.Tensor:
        """The serial-layout ``t`` as this rank's parameter ``name`` holds it (its slice)."""
        return t

    # -- state in the serial layout, keyed by parameter name, one tensor at a time (collective
    # but here: at most one whole tensor beyond this rank's slices) -------------------------------

    def model_state(self, model, keep: bool = True) -> dict:
        """The weights in the serial layout (``keep`` false: {}, the collectives only)."""
        params = {n: self.to_serial(model, n, p, keep)
                  for n, p in resharded(model).named_parameters()}
        return params | dict(model.named_buffers()) if keep else {}

    def load_model_state(self, model, state: dict):
        with torch.no_grad():
            for name, p in resharded(model).named_parameters():
                p.copy_(self.from_serial(model, name, state[name]))
            for name, b in model.named_buffers():
                b.copy_(state[name])

    def optimizer_state(self, model, optimizer, keep: bool = True) -> dict:
        """Adam's state in the serial layout, by name (``keep`` false: the collectives only)."""
        names = {id(p): n for n, p in resharded(model).named_parameters()}
        state = {}
        for p in (p for g in optimizer.param_groups for p in g["params"]):
            for key, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:  # a moment, like the parameter
                    v = self.to_serial(model, names[id(p)], v, keep)
                state.setdefault(names[id(p)], {})[key] = v
        # hyperparameters as plain numbers (also a CUDA-graph step's device-tensor lr)
        groups = [{k: v.item() if torch.is_tensor(v) and v.dim() == 0 else v
                   for k, v in g.items() if k != "params"}
                  | {"params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, model, optimizer, saved: dict):
        names = {id(p): n for n, p in resharded(model).named_parameters()}
        current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        if [sorted(g) for g in current] != [sorted(g["params"]) for g in saved["param_groups"]]:
            raise ValueError("the checkpoint's optimizer holds other parameters than this model")
        # (torch pairs saved state with parameters by position: this optimizer's order)
        index = {n: i for i, n in enumerate(n for g in current for n in g)}
        state = {index[name]: {k: self.from_serial(model, name, v)
                               if torch.is_tensor(v) and v.dim() > 0 else v for k, v in st.items()}
                 for name, st in saved["state"].items()}
        groups = [sg | {"params": [index[n] for n in cur]}
                  for sg, cur in zip(saved["param_groups"], current)]
        load_optimizer_state(optimizer, {"state": state, "param_groups": groups})


class RowBandSharding(Unsharded):
    """Tensor/context-parallel ViT (``distributed.parallelize.ParallelViT``): bands of image rows."""

    def __init__(self, task, model, groups):
        super().__init__(task)
        self.model, self.groups = model, groups

    def local_batch(self, x, y):
        """This rank's band of image rows, cut from whole images; a batch that is the band
        already (a loader reading ``model.image_rows()`` only) passes as it is."""
        start, stop = self.model.image_rows()
        if x.shape[-2] == stop - start and y.shape[-2] == stop - start:
            return x, y
        return self.model.shard_image(x), self.model.shard_image(y)

    def loss(self, pred, y):
        # The task's per-band partial sums, added over the ranks holding other bands: the serial loss.
        return sharded_loss(self.task.loss, pred, y, self.groups, self.model.layout,
                            self.model.image_rows())

    def whole_output(self, pred):
        return self.model.gather_image(pred)

    def register_grad_hooks(self, ddp_model):
        # (the hook also sums over tp/cp the gradients of parameters replicated there)
        ddp_model.register_comm_hook(self.groups, replicated_grads_comm_hook)

    def whole(self, model, name, t):  # collective over tp/cp
        return tensors_to_serial(model, self.groups, {name: t})[name]

    def from_serial(self, model, name, t):
        return tensors_from_serial(model, self.groups, {name: t})[name]


# Every rank holds the whole tensor (it read the checkpoint): each keeps its slice, without the
# scatter from rank 0 that distribute_tensor does by default (torch >= 2.7 can skip it).
_KEEP_LOCAL_SLICE = {"src_data_rank": None} \
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}


class FullyShardedSharding(Unsharded):
    """FSDP2 (``fully_shard``) over the data-parallel ranks, on top of ``inner`` (``Unsharded``,
    or ``RowBandSharding`` whose slices FSDP shards further), whose batches, losses and outputs
    these are."""

    def __init__(self, task, inner: Unsharded):
        super().__init__(task)
        self.inner = inner
        self.writes_shards = type(inner) is Unsharded  # (DCP could not place tp/cp's slices)
        self.local_batch, self.loss, self.whole_output = inner.local_batch, inner.loss, inner.whole_output

    def reduce_replicated_grads(self, model):
        """The tp/cp sums of replicated parameters' gradients (without FSDP: DDP's hook)."""
        if isinstance(self.inner, RowBandSharding):
            reduce_replicated_grad_shards(model, self.inner.groups)

    def whole(self, model, name, t):  # gathered over dp (collective), then over tp/cp by ``inner``
        return self.inner.whole(model, name, t.full_tensor() if isinstance(t, DTensor) else t)

    def from_serial(self, model, name, t):
        if isinstance(t, DTensor):  # a shard DCP read: as it is
            return t
        t, p = self.inner.from_serial(model, name, t), model.get_parameter(name)
        if isinstance(p, DTensor):
            t = distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements,
                                  **_KEEP_LOCAL_SLICE)
        return t


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory, in torch's default layout whatever the memory_format."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


def resharded(model):
    """``model`` with every FSDP unit's shards in place (not validation's gathered weights)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model
