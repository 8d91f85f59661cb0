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

    def to_serial(self, model, tensors: dict, keep: bool = True) -> dict:
        """``tensors`` (like this rank's parameters, by name) in the serial layout, copied to host
        memory one by one; ``keep`` false: {}, on a rank that only takes part in the collectives."""
        return {k: _to_host(t) for k, t in tensors.items()} if keep else {}

    def from_serial(self, model, tensors: dict) -> dict:
        return tensors

    # -- state in the serial layout, keyed by parameter name (collective for RowBandSharding) ---

    def model_state(self, model, keep: bool = True) -> dict:
        """The weights in the serial layout (``keep`` false: {}, the collectives only)."""
        params = self.to_serial(model, dict(model.named_parameters()), keep)
        return params | dict(model.named_buffers()) if keep else params

    def load_model_state(self, model, state: dict):
        params = self.from_serial(model, {n: state[n] for n, _ in model.named_parameters()})
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
            for name, b in model.named_buffers():
                b.copy_(state[name])

    def optimizer_state(self, model, optimizer, keep: bool = True) -> dict:
        """Adam's state in the serial layout, by name (``keep`` false: the collectives only)."""
        names = {id(p): n for n, p in model.named_parameters()}
        state, per_param = {}, {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, v in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        per_param.setdefault(key, {})[names[id(p)]] = v
                    else:
                        state.setdefault(names[id(p)], {})[key] = v
        for key, tensors in per_param.items():
            for name, t in self.to_serial(model, tensors, keep).items():
                state.setdefault(name, {})[key] = t
        # hyperparameters as plain numbers (also a CUDA-graph step's device-tensor lr)
        groups = [{k: v.item() if torch.is_tensor(v) and v.dim() == 0 else v
                   for k, v in g.items() if k != "params"}
                  | {"params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, model, optimizer, saved: dict):
        names = {id(p): n for n, p in model.named_parameters()}
        current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        if [sorted(g) for g in current] != [sorted(g["params"]) for g in saved["param_groups"]]:
            raise ValueError("the checkpoint's optimizer holds other parameters than this model")
        keys = {k for st in saved["state"].values() for k, v in st.items()
                if torch.is_tensor(v) and v.dim() > 0}
        local = {key: self.from_serial(model, {n: st[key] for n, st in saved["state"].items()
                                               if key in st}) for key in keys}
        # (torch pairs saved state with parameters by position: this optimizer's order)
        index = {n: i for i, n in enumerate(n for g in current for n in g)}
        state = {index[name]: {k: (local[k][name] if k in local else v) for k, v in st.items()}
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

    def to_serial(self, model, tensors, keep=True):
        # collective over tp/cp, one tensor at a time: at most one whole tensor beyond the slices
        out = {}
        for name, t in tensors.items():
            whole = tensors_to_serial(model, self.groups, {name: t})
            if keep:
                out.update((k, _to_host(v)) for k, v in whole.items())
        return out

    def from_serial(self, model, tensors):
        return tensors_from_serial(model, self.groups, tensors)


# Every rank holds the whole tensor (it read the checkpoint): each keeps its slice, without the
# scatter from rank 0 that distribute_tensor does by default (torch >= 2.7 can skip it).
_KEEP_LOCAL_SLICE = {"src_data_rank": None} \
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters else {}


class FullyShardedSharding(Unsharded):
    """FSDP2 (``fully_shard``) over the data-parallel ranks, on top of ``inner`` (``Unsharded``,
    or ``RowBandSharding`` whose slices FSDP shards further), whose batches, losses and outputs
    these are. Checkpoints of FSDP alone hold the shards (DCP); with tp/cp (slices DCP could not
    place) the serial layout (docs/parallelism.md)."""

    def __init__(self, task, inner: Unsharded):
        super().__init__(task)
        self.inner = inner
        self.writes_shards = type(inner) is Unsharded
        self.local_batch, self.loss, self.whole_output = inner.local_batch, inner.loss, inner.whole_output

    def reduce_replicated_grads(self, model):
        """The tp/cp sums of replicated parameters' gradients (without FSDP: DDP's hook)."""
        if isinstance(self.inner, RowBandSharding):
            reduce_replicated_grad_shards(model, self.inner.groups)

    def model_state(self, model, keep: bool = True) -> dict:
        return super().model_state(resharded(model), keep)

    def load_model_state(self, model, state: dict):
        super().load_model_state(resharded(model), state)

    def optimizer_state(self, model, optimizer, keep: bool = True) -> dict:
        return super().optimizer_state(resharded(model), optimizer, keep)

    def load_optimizer_state(self, model, optimizer, saved: dict):
        super().load_optimizer_state(resharded(model), optimizer, saved)

    def to_serial(self, model, tensors, keep=True):
        # one tensor at a time: gathered over dp (collective), then over tp/cp by ``inner``
        out = {}
        for k, t in tensors.items():
            whole = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
            out.update(self.inner.to_serial(model, {k: whole}, keep))
            del whole
        return out

    def from_serial(self, model, tensors):
        like = dict(model.named_parameters())
        shards = {k: t for k, t in tensors.items() if isinstance(t, DTensor)}  # read by DCP: as they are
        out = self.inner.from_serial(model, {k: t for k, t in tensors.items() if k not in shards})
        for name, t in out.items():
            p = like[name]
            if isinstance(p, DTensor):
                out[name] = distribute_tensor(t.to(p.device, p.dtype), p.device_mesh, p.placements,
                                              **_KEEP_LOCAL_SLICE)
        return out | shards


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory, in torch's default layout whatever the memory_format."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())


def resharded(model):
    """``model`` with every FSDP unit's shards in place (not validation's gathered weights)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return model
