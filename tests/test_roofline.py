"""The roofline model (benchmarks/roofline_model.py) against the real models' ops at toy sizes: every
group's FLOPs against torch's FLOP counter and the task's count, its bytes against the tensors
its ops read and write; the floor; and benchmarks/roofline.py end to end on the CPU."""
import contextlib
import json
from collections import defaultdict

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count
from torch.utils.module_tracker import ModuleTracker

from conftest import ROOT
from benchmarks import roofline_model as roofline
from settings.parse import build_config
from tasks import make_task

VIT_TOY = {"img_size": [16, 32], "patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2,
           "n_in_channels": 4, "n_out_channels": 3}
UNET_TOYS = [  # five levels; six (one crop: 64^3 is the least six levels take), widths capped
    ({"base_width": 2, "max_width": 8, "full_scale": False, "data_size": 32}, 2),
    ({"base_width": 1, "max_width": 2, "full_scale": True, "data_size": 64}, 1),
]


def vit_cfg(**kw):
    return build_config(f"{ROOT}/config/ViT.yaml", "base", {**VIT_TOY, **kw})


def unet_cfg(size):
    return build_config(f"{ROOT}/config/UNet.yaml", "base", size)


def _tensors(x):
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's values as stored: a broadcast (stride 0) dimension counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride:
            n *= size
    return n * t.element_size() if t.numel() else 0


def op_bytes(func, args, kwargs, out) -> tuple[int, int]:
    """(read, written) bytes of one ATen op on real tensors: the arguments it reads, the outputs
    it makes and the arguments it writes in place (its schema's ``!``). A view (nothing written)
    moves nothing; ops that only take another tensor's shape (``*_like``, ``new_*``) read
    nothing; ``_fused_adam_``'s schema marks the gradients writable (for unscaling), but
    without a grad scale it only reads them."""
    name = func._overloadpacket.__name__
    written = 0
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if name == "_fused_adam_" and arg.name == "grads":
            continue
        val = args[i] if i < len(args) else kwargs.get(arg.name)
        written += sum(stored_bytes(t) for t in _tensors(val))
    inputs = _tensors((args, kwargs))
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    written += sum(stored_bytes(o) for o in _tensors(out)
                   if o.untyped_storage().data_ptr() not in storages)
    if not written:
        return 0, 0
    if name.endswith("_like") or name.startswith("new_"):
        return 0, written
    return sum(stored_bytes(t) for t in inputs), written


class OpRecorder(TorchDispatchMode):
    """Every ATen op of a step, its group by the step model's rules, its bytes (``op_bytes``)
    and FLOPs (torch.utils.flop_counter's formulas), summed per (group, phase).

    Forward: the module an op runs in (ModuleTracker) and its name give the group, and the
    autograd node its outputs get is noted. Backward: the node being run
    (``torch._C._current_autograd_node``) gives the group of the forward op that made it,
    except for casts (the cast group) and the sums of two gradients of one tensor (autograd's
    ``add``: the accumulation group). ``phase`` is set by the caller: fwd, bwd, opt.

    ``relayouts``: the copies AccumulateGrad makes when a weight's gradient arrives in another
    layout than the weight's (a channels-last weight given a contiguous gradient), kept apart.
    Which layout a convolution's backward gives the gradient depends on the kernel the CPU
    runs (oneDNN's choice by instruction set: seen on one machine and not on another)."""

    def __init__(self, step: roofline.StepModel, tracker: ModuleTracker):
        super().__init__()
        self.step, self.tracker = step, tracker
        self.phase = "fwd"
        self.pending = []  # (tensor, group): outputs of the last forward op
        self.node_group = {}  # autograd node's sequence number -> group
        self.cats = 0
        self.sums = defaultdict(lambda: {"bytes": 0, "flops": 0, "ops": []})
        self.unplaced = []
        self.relayouts = []  # (op, bytes, shape)

    def _module(self):
        inside = [p for p in self.tracker.parents if p != "Global"]
        if not inside:
            return None
        return max(inside, key=len).partition(".")[2]  # "ViT.blocks.0.attn" -> "blocks.0.attn"

    def _note_nodes(self):
        for t, group in self.pending:
            if t.grad_fn is not None:
                self.node_group.setdefault(t.grad_fn._sequence_nr(), group)
        self.pending = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._note_nodes()
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        read, written = op_bytes(func, args, kwargs, out)
        fl = flop_registry.get(func._overloadpacket)
        flops = fl(*args, **kwargs, out_val=out) if fl else 0
        if self.phase == "fwd":
            module = self._module()
            cat = None
            if name == "cat" and module == "":
                cat, self.cats = self.cats, self.cats + 1
            group = self.step.classify(module, name, cat)
            self.pending = [(t, group) for t in _tensors(out)]
        elif self.phase == "opt":
            group = "optimizer"
        else:
            node = torch._C._current_autograd_node()
            if node is not None and "AccumulateGrad" in node.name() and \
                    name in ("new_empty_strided", "copy_"):
                self.relayouts.append((name, read + written, tuple(_tensors(out)[0].shape)))
                return out
            # no node: the seed of loss.backward(), the loss's gradient
            fwd = self.node_group.get(node._sequence_nr()) if node is not None else "loss"
            if name in roofline.CASTS:
                group = self.step.cast_group
            elif name == "add" and fwd not in (None, "loss"):
                group = self.step.accumulation_group
            else:
                group = fwd
        if not (read + written or flops):
            return out  # a view: nothing to place
        if group is None:
            self.unplaced.append((name, read + written))
        else:
            s = self.sums[(group, self.phase)]
            s["bytes"] += read + written
            s["flops"] += flops
            s["ops"].append((name, read + written))
        return out


def record_step(task, step: roofline.StepModel, amp: bool, math_attention=False,
                channels_last=False):
    """Run one training step of the task's model at toy size (a warm-up step first, so that
    Adam's state exists) and record its ops; fused Adam, as on a GPU."""
    torch.manual_seed(0)
    fmt = torch.channels_last_3d if channels_last else torch.contiguous_format
    model = task.build_model().to(memory_format=fmt)
    cfg = task.cfg
    shape = cfg.img_size if hasattr(cfg, "img_size") else [cfg.data_size] * 3
    x = torch.randn(step.batch, cfg.n_in_channels, *shape).contiguous(memory_format=fmt)
    y = torch.randn(step.batch, cfg.n_out_channels, *shape).contiguous(memory_format=fmt)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def run(rec=None):
        kernels = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), kernels:
            loss = task.loss(model(x), y).mean()
        if rec:
            rec._note_nodes()
            rec.phase = "bwd"
        loss.backward()
        if rec:
            rec.phase = "opt"
        opt.step()
        opt.zero_grad(set_to_none=True)
    run()
    with ModuleTracker() as tracker, OpRecorder(step, tracker) as rec:
        run(rec)
    return rec


def _models(fp32=True):
    """The toy models (config, batch), each in fp32 and bf16 autocast, as pytest params. The
    six-level U-Net in bf16 alone: its first fp32 backward on a CPU takes seconds (oneDNN
    makes its kernels for the 64^3 shapes), and the five-level one checks the fp32 model."""
    out = []
    models = [("vit", vit_cfg(), 2)] + [(f"unet{i}", unet_cfg(size), b)
                                        for i, (size, b) in enumerate(UNET_TOYS)]
    for name, cfg, batch in models:
        for amp in ((False, True) if fp32 and name != "unet1" else (True,)):
            out.append(pytest.param(cfg, batch, amp, id=f"{name}-{'bf16' if amp else 'fp32'}"))
    return out


@pytest.mark.parametrize("cfg,batch,amp,channels_last", [
    *(pytest.param(*p.values, False, id=p.id) for p in _models()),
    pytest.param(unet_cfg(UNET_TOYS[0][0]), 2, True, True, id="unet0-bf16-channels_last")])
def test_every_groups_bytes_are_those_its_ops_read_and_write(cfg, batch, amp, channels_last):
    task = make_task(cfg)
    step = roofline.step_model(task, batch=batch, amp=amp)  # either layout: the same ops
    rec = record_step(task, step, amp, channels_last=channels_last)
    assert not rec.unplaced
    # weight gradients copied into their weights' layout (channels-last only): weight-shaped
    shapes = {tuple(p.shape) for p in task.build_model().parameters()}
    assert all(shape in shapes for _, _, shape in rec.relayouts), rec.relayouts
    assert not rec.relayouts or channels_last, rec.relayouts
    assert {g for g, _ in rec.sums} <= set(step.groups)
    for group in step.groups:
        for phase in ("fwd", "bwd", "opt"):
            model = step.totals(group, phase)["bytes"]
            measured = rec.sums[(group, phase)]["bytes"]
            # the loss's per-sample values (B of them) are left out of the model
            slack = 64 * 4 * step.batch if group == "loss" else 0
            assert abs(measured - model) <= slack, (group, phase, measured, model,
                                                    rec.sums[(group, phase)]["ops"])


@pytest.mark.parametrize("cfg,batch,amp", _models(fp32=False))
def test_every_groups_flops_are_those_torch_counts(cfg, batch, amp):
    task = make_task(cfg)
    step = roofline.step_model(task, batch=batch, amp=amp)
    # the counter has no formula for the CPU's fused attention; the math form it counts
    rec = record_step(task, step, amp=amp, math_attention=True)
    for group in step.groups:
        for phase in ("fwd", "bwd"):
            assert rec.sums[(group, phase)]["flops"] == step.totals(group, phase)["model_flops"], \
                (group, phase)
    # the model's FLOPs add up to the task's count and to the counter's total on the model
    assert step.totals()["model_flops"] == batch * task.flops_per_sample()
    torch.manual_seed(0)
    model = task.build_model()
    shape = cfg.img_size if hasattr(cfg, "img_size") else [cfg.data_size] * 3
    x = torch.randn(batch, cfg.n_in_channels, *shape)
    with torch.autocast("cpu", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH), \
            FlopCounterMode(display=False) as counter:
        model(x).float().square().mean().backward()
    assert counter.get_total_flops() == step.totals()["model_flops"]


def test_fused_attention_backward_executes_2_5_times_its_forward():
    cfg = vit_cfg()
    step = roofline.vit_model(cfg, batch=2, amp=True)
    n, e, heads = 4 * 8, cfg.embed_dim, cfg.num_heads
    shape = (2, heads, n, e // heads)
    fwd = step.totals("attention", "fwd")["flops"]
    bwd = step.totals("attention", "bwd")
    assert fwd == cfg.depth * 4 * 2 * n * n * e
    # torch's flop counter's own formula for the fused kernels' backward
    assert bwd["flops"] == cfg.depth * sdpa_backward_flop_count(shape, shape, shape, shape)
    assert bwd["flops"] == 5 * fwd // 2 and bwd["model_flops"] == 2 * fwd


@pytest.mark.parametrize("cfg,batch,amp", _models(fp32=False))
def test_parameters_are_the_models(cfg, batch, amp):
    task = make_task(cfg)
    step = roofline.step_model(task, batch=1, amp=False)
    real = sorted((n, p.numel()) for n, p in task.build_model().named_parameters())
    assert sorted(step.params) == real


def test_the_floor_is_the_larger_bound_by_hand():
    # 2 GFLOP and 100 MB at 1 TFLOP/s and 100 GB/s: 2 ms of compute, 1 ms of memory
    f = roofline.floor(2e9, 1e8, 1e12, 1e11)
    assert f == {"compute_ms": 2.0, "memory_ms": 1.0, "floor_ms": 2.0, "bound": "compute"}
    f = roofline.floor(0, 1e8, 1e12, 1e11)
    assert f["floor_ms"] == f["memory_ms"] == 1.0 and f["bound"] == "memory"
    # a Linear(4 -> 2) with bias on 8 rows in fp32, by hand: forward addmm reads x (8 x 4),
    # W (2 x 4) and b (2), writes y (8 x 2): (32 + 8 + 2 + 16) x 4 bytes, 2 x 8 x 4 x 2 FLOPs
    ops = roofline._Ops(amp=False, cast_group="copies")
    ops.linear("g", "lin", 8, 4, 2)
    fwd, = [o for o in ops if o.phase == "fwd"]
    assert (fwd.read, fwd.written, fwd.flops) == (4 * 42, 4 * 16, 128)
    # backward: input gradient (dy, W -> dx), weight gradient (dy, x -> dW), bias (dy -> db)
    assert [(o.read, o.written, o.flops) for o in ops if o.phase == "bwd"] == [
        (4 * (16 + 8), 4 * 32, 128), (4 * (16 + 32), 4 * 8, 128), (4 * 16, 4 * 2, 0)]
    rows = roofline.StepModel("x", 8, False, list(ops), ("g",), [], None, "", "").rows(1e9, 1e9)
    assert rows[0]["floor_ms"] == pytest.approx(max(3 * 128, sum(o.bytes for o in ops)) / 1e6)


def test_the_tutorials_models_step_sums():
    """At the tutorial's sizes (batch 16 ViT, 64 U-Net, bf16): the FLOPs are the task's and
    the groups cover the step."""
    for yaml, batch in (("ViT", 16), ("UNet", 64)):
        task = make_task(build_config(f"{ROOT}/config/{yaml}.yaml", "short"))
        step = roofline.step_model(task, batch, amp=True)
        assert step.totals()["model_flops"] == batch * task.flops_per_sample()
        rows = step.rows(989e12, 4.8e12)
        assert sum(r["bytes"] for r in rows) == step.totals()["bytes"]
        assert all(r["floor_ms"] == max(r["compute_ms"], r["memory_ms"]) for r in rows)


def test_gpu_attribution_by_kernels_is_that_of_the_cpu_ops():
    """On a GPU a group's time is its ops' kernels': give every op of a CPU profile a kernel
    as long as its own CPU time, and the kernel attribution must give the CPU's."""
    from benchmarks import roofline as bench
    from torch.profiler import profile
    cfg = vit_cfg()
    task = make_task(cfg)
    step = roofline.step_model(task, batch=2, amp=False)
    torch.manual_seed(0)
    model = task.build_model()
    x, y = torch.randn(2, 4, 16, 32), torch.randn(2, 3, 16, 32)
    opt = torch.optim.Adam(model.parameters(), fused=True)
    with bench.ModuleRanges(model), profile() as prof:
        with torch.profiler.record_function(bench.STEP_RANGE):
            task.loss(model(x), y).mean().backward()
            with torch.profiler.record_function(bench.OPT_RANGE):
                opt.step()
    events = prof.events()
    cpu = bench.attribute(events, step, gpu=False)
    assert all(cpu["times_ms"][g] > 0 for g in step.groups)
    for e in events:
        if e.self_cpu_time_total > 0:
            e.append_kernel("kernel of " + e.name, 0, e.self_cpu_time_total)
    gpu = bench.attribute(events, step, gpu=True)
    assert gpu["times_ms"] == pytest.approx(cpu["times_ms"])
    assert gpu["unattributed_ms"] == pytest.approx(cpu["unattributed_ms"])


def test_small_run_end_to_end(tmp_path, capsys):
    """``python -m benchmarks.roofline --small``: a table per model whose numbers add up."""
    from benchmarks import roofline as bench
    out = tmp_path / "roofline.json"
    bench.main(["--small", "--budget", "120", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert printed.strip() == result["markdown"].strip()
    assert result["rates"]["matmul_flops_per_s"] > 0 and result["rates"]["bytes_per_s"] > 0
    assert [m["model"] for m in result["models"]] == ["vit", "unet"]
    for m in result["models"]:
        yaml = {"vit": "ViT", "unet": "UNet"}[m["model"]]
        overrides, batch = bench.SMALL[m["model"]]
        task = make_task(build_config(f"{ROOT}/config/{yaml}.yaml", "short", overrides))
        step = roofline.step_model(task, batch, amp=False)
        assert [r["group"] for r in m["rows"]] == list(step.groups)
        assert m["flops"] == sum(r["flops"] for r in m["rows"]) == step.totals()["flops"]
        assert m["bytes"] == sum(r["bytes"] for r in m["rows"]) == step.totals()["bytes"]
        assert m["roofline_ms"] == pytest.approx(sum(r["floor_ms"] for r in m["rows"]))
        assert m["attributed_ms"] == pytest.approx(sum(r["measured_ms"] for r in m["rows"]))
        for r in m["rows"]:
            assert r["floor_ms"] == max(r["compute_ms"], r["memory_ms"])
            if r["bytes"]:  # every group that moves data has a floor and a measured time
                assert r["floor_ms"] > 0 and r["measured_ms"] > 0
                assert r["ratio"] == pytest.approx(r["measured_ms"] / r["floor_ms"])
        # the profiled step is the attributed time and the unattributed parts
        assert m["attributed_ms"] + sum(m["unattributed_ms"].values()) == pytest.approx(
            m["profiled_step_ms"], rel=0.02)
        table = "| group | FLOPs | bytes | floor ms | bound | measured ms | measured/floor |"
        assert table in result["markdown"]
    assert result["markdown"].count("| **total** |") == 2
    assert result["markdown"].count("| unattributed |") == 2
