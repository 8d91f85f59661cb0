"""train_graph.py: the training step captured once as a CUDA graph and replayed.

On a CPU the capture itself cannot run; everything around it does, through ``ReplayOnCPU``, a
stand-in for ``engine.cuda_graph.CudaGraphOps`` whose replay re-runs the recorded step on the
static buffers with the semantics of a CUDA replay (the same output tensors every time,
gradients written afresh). So these tests check, without a GPU: the warm-up / capture / replay
sequence and the static buffers; the optimizer a captured step needs (fused Adam, the learning
rate a tensor the schedule fills in place); that a graph-trained run equals train.py step for
step; that checkpoints cross between the two scripts; and the one-line refusal on a CPU. The
real capture is the ``gpu``-marked test at the end.
"""
import contextlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from distributed_harness import run_ranks
from train import Trainer
from train_graph import GraphTrainer
from engine import checkpoint
from settings.parse import build_config
from engine.cuda_graph import CudaGraphOps, StepGraph, capture_warmup_steps, check_can_capture
from settings.errors import ConfigError, TrainingError
from engine.optimizer import lr_at
from engine.runtime import Runtime, setup_runtime

TINY_VIT = dict(img_size="[16,32]", patch_size="4", embed_dim="32", depth="1", num_heads="2",
                global_batch_size="4", base_batch_size="4", lr="2e-3", warmup_steps="3",
                synthesize_if_missing="false", log_every="2", num_data_workers="0",
                enable_fused="true", grad_accum_steps="2", max_grad_norm="0.5")


class ReplayOnCPU:
    """CudaGraphOps on a CPU: no streams; a replay runs the captured function again (after what
    capture assumed, ``clear``) and writes its results into the tensors of the first replay."""

    def __init__(self):
        self.captures = self.replays = 0

    def side_stream(self):
        return contextlib.nullcontext()

    def synchronize(self):
        pass

    def capture(self, fn, clear):
        self.captures += 1
        step = SimpleNamespace(replay=None, outputs=None)

        def replay():
            self.replays += 1
            clear()
            out = fn()
            if step.outputs is None:
                step.outputs = out
            else:
                for static, new in zip(step.outputs, out):
                    static.copy_(new)

        step.replay = replay
        return step


# ---------------------------------------------------------------------- StepGraph on its own


def test_warm_up_then_one_capture_then_replays_on_static_buffers():
    ops, cleared, seen = ReplayOnCPU(), [], []

    def body(x, y, probe):
        seen.append((x.data_ptr(), y.data_ptr()))
        return (x * 2 + y).sum(), x.max()

    graph = StepGraph(body, lambda: cleared.append(1), ops, warmup_steps=3, timed=2)
    outs = []
    for i in range(7):
        x, y = torch.full((2, 3), float(i)), torch.full((2, 3), 10.0 * i)
        loss, top = graph(x, y)
        assert loss.item() == pytest.approx(6 * (2 * i + 10 * i)) and top.item() == i
        outs.append((loss, top, graph.last_mode))
    assert [m for *_, m in outs] == ["eager"] * 3 + ["capture"] + ["replay"] * 3
    assert ops.captures == 1 and ops.replays == 4
    assert len(cleared) == 3 + 1 + 4  # after each eager step, before capture, (stand-in) replays
    # every call read the same two buffers; every replay returned the same output tensors
    assert len(set(seen)) == 1
    assert all(o[0] is outs[3][0] and o[1] is outs[3][1] for o in outs[3:])
    assert len(graph.eager_s) == 2 and len(graph.replay_s) == 2
    assert "x" in graph.speedup_line() and "eager (2 warm-up steps)" in graph.speedup_line()


def test_a_batch_of_another_shape_is_refused_with_the_reason():
    graph = StepGraph(lambda x, y, probe: (x.sum(),), lambda: None, ReplayOnCPU(), warmup_steps=1)
    graph(torch.ones(4, 2), torch.ones(4))
    with pytest.raises(TrainingError, match=r"fixed shapes: this input batch is \(3, 2\)"):
        graph(torch.ones(3, 2), torch.ones(3))
    with pytest.raises(TrainingError, match="target batch .* torch.float64"):
        graph(torch.ones(4, 2), torch.ones(4, dtype=torch.float64))


def test_what_cannot_be_captured_is_refused_before_anything_is_written(tmp_path):
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", {"expdir": str(tmp_path)})
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*run train.py"):
        check_can_capture(cfg, torch.device("cpu"), model_parallel=False)
    with pytest.raises(ConfigError, match="use train_mp.py"):
        check_can_capture(cfg, torch.device("cuda"), model_parallel=True)
    jit = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", {"enable_jit": "true"})
    with pytest.raises(ConfigError, match="drop --enable_jit"):
        check_can_capture(jit, torch.device("cuda"), model_parallel=False)
    check_can_capture(cfg, torch.device("cuda"), model_parallel=False)  # a plain run passes
    assert not os.listdir(tmp_path)


def test_ddp_warm_up_keeps_ddps_timed_iterations_out_of_the_capture(tmp_path):
    """DDP times iterations 1-10 and every 100th with CUDA events and reads them at the next
    iteration: the captured iteration (warm-up + 1) may touch neither."""
    def cfg(w):
        return build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                            {"graph_warmup_steps": str(w), "expdir": str(tmp_path / "logs")})
    assert capture_warmup_steps(cfg(3), ddp=False) == 3
    assert capture_warmup_steps(cfg(99), ddp=False) == 99  # no DDP, nothing timed
    assert capture_warmup_steps(cfg(3), ddp=True) == 11
    assert capture_warmup_steps(cfg(150), ddp=True) == 150
    for w in (99, 100, 199, 200):
        with pytest.raises(ConfigError, match=rf"graph_warmup_steps={w} under DDP puts iteration "
                                              rf"{w + 1}.*choose (98|198) or (101|201)"):
            capture_warmup_steps(cfg(w), ddp=True)
    # The engine refuses it before the run directory exists.
    rt = Runtime(device=torch.device("cpu"), world_size=2, dp_size=2, local_batch=2,
                 global_batch=4)
    with pytest.raises(ConfigError, match="graph_warmup_steps=99"):
        GraphTrainer(cfg(99), rt, ops=ReplayOnCPU())
    assert not (tmp_path / "logs").exists()


def test_capture_is_thread_local_so_loader_threads_cannot_break_it(monkeypatch):
    """The pin-memory thread and DALI's threads make CUDA calls while the step is captured; a
    global-mode capture would be invalidated by them."""
    seen = {}

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(g, **kw):
        seen.update(kw)
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    ops = object.__new__(CudaGraphOps)
    ops.stream = "side stream"
    step = ops.capture(lambda: (torch.ones(1),), lambda: None)
    assert seen == {"stream": "side stream", "capture_error_mode": "thread_local"}
    assert torch.equal(step.outputs[0], torch.ones(1))


def test_train_graph_on_a_cpu_exits_2_naming_train_py(tmp_path, era5_root):
    exp = tmp_path / "logs"
    r = subprocess.run([sys.executable, "train_graph.py", "--data_root", era5_root,
                        "--expdir", str(exp), "--num_iters", "2"], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "train.py" in lines[0], r.stderr
    assert not exp.exists()


# ---------------------------------------------------------------------- the whole run


class Noting:
    """Notes each step's loss and learning rate (mixed into a trainer class)."""

    def __init__(self, cfg, rt, **kw):
        super().__init__(cfg, rt, **kw)
        self.losses, self.lrs = [], []

    def train_step(self, x, y, *args):
        self.lrs.append(self.optimizer.param_groups[0]["lr"])
        loss, norm = super().train_step(x, y, *args)
        self.losses.append(loss.item())
        return loss, norm


class NotingTrainer(Noting, Trainer):
    pass


class NotingGraphTrainer(Noting, GraphTrainer):
    pass


def _train(cls, era5_root, expdir, steps, **over):
    over = dict(TINY_VIT, data_root=era5_root, expdir=str(expdir), num_iters=str(steps),
                **{k: str(v) for k, v in over.items()})
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart", over)
    kw = {"ops": ReplayOnCPU()} if cls is NotingGraphTrainer else {}
    tr = cls(cfg, setup_runtime(cfg), **kw)
    tr.fit()
    return tr


def _assert_same_weights(a, b):
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_graph_trained_run_equals_train_py_step_for_step(tmp_path, era5_root):
    eager = _train(NotingTrainer, era5_root, tmp_path / "eager", 8)
    graph = _train(NotingGraphTrainer, era5_root, tmp_path / "graph", 8, checkpoint_every=4)
    ops = graph.step_graph.ops
    assert ops.captures == 1 and ops.replays == 8 - 3  # 3 eager warm-up steps (the default)
    torch.testing.assert_close(graph.losses, eager.losses, rtol=1e-5, atol=1e-7)
    _assert_same_weights(graph, eager)
    # the learning rate is one tensor, filled in place with the schedule's value of each step
    lr = graph.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and all(t is lr for t in graph.lrs)
    peak = graph.peak_lr
    assert float(lr) == pytest.approx(lr_at(8, peak, 0.0, 3, 8), abs=1e-9)
    assert eager.lrs == pytest.approx([lr_at(s, peak, 0.0, 3, 8) for s in range(8)])
    assert graph.optimizer.param_groups[0]["fused"] is True
    # the checkpoint holds plain numbers, as train.py writes them
    state, _ = checkpoint.load_latest(graph.ckpt_dir)
    assert all(not torch.is_tensor(g["lr"]) for g in state["optimizer"]["param_groups"])


def test_checkpoints_cross_between_train_py_and_train_graph(tmp_path, era5_root):
    whole = _train(NotingTrainer, era5_root, tmp_path / "whole", 8)
    for first, second, name in ((NotingGraphTrainer, NotingTrainer, "g2e"),
                                (NotingTrainer, NotingGraphTrainer, "e2g")):
        ckpts = _train(first, era5_root, tmp_path / name, 8, checkpoint_every=4).ckpt_dir
        os.remove(checkpoint.path_for(ckpts, 8))  # as if stopped after step 4
        resumed = _train(second, era5_root, tmp_path / name, 8, resume="true")
        torch.testing.assert_close(resumed.losses, whole.losses[4:], rtol=1e-5, atol=1e-7)
        _assert_same_weights(resumed, whole)
        lr = resumed.optimizer.param_groups[0]["lr"]
        assert torch.is_tensor(lr) == (second is NotingGraphTrainer)


def test_the_profiler_window_never_opens_over_the_capture(tmp_path, era5_root):
    """5 steps an epoch: the trace window (1 wait + 1 warm-up + 3 active steps) would open at
    step 5, the second epoch's first; with 6 warm-up steps the capture is step 6, so the window
    moves to step 7 (its traced steps 9-11)."""
    trace = tmp_path / "trace"
    graph = _train(NotingGraphTrainer, era5_root, tmp_path / "g", 12, graph_warmup_steps=6,
                   profile_trace=str(trace))
    assert graph.steps_per_epoch == 5 and graph.step_graph.ops.captures == 1
    assert graph.run_log.trace.written == [str(trace / "trace_rank0_step9.json")]
    log = open(os.path.join(graph.run_dir, "out.log")).read()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (set by train_graph.py)" in log \
        or "TORCH_NCCL_ASYNC_ERROR_HANDLING=" in log and "(from the environment)" in log, log


def _graph_rank(era5_root, expdir):
    tr = _train(NotingGraphTrainer, era5_root, expdir, 14)
    weights = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    return tr.losses, weights, tr.step_graph.ops.replays


def test_data_parallel_graph_run_warms_up_11_steps_and_equals_one_process(tmp_path, era5_root):
    """Two gloo ranks (DDP's all-reduce inside the replayed step) against train.py on one."""
    one = _train(NotingTrainer, era5_root, tmp_path / "one", 14)
    ranks = run_ranks(_graph_rank, 2, era5_root, str(tmp_path / "two"), timeout=300)
    assert [replays for *_, replays in ranks] == [14 - 11] * 2  # DDP's warm-up before capture
    # each rank's loss is that of its half of the batch; their mean is the one-process loss
    mean = [(a + b) / 2 for a, b in zip(ranks[0][0], ranks[1][0])]
    torch.testing.assert_close(mean, one.losses, rtol=1e-5, atol=1e-6)
    flat = torch.cat([p.detach().flatten() for p in one.model.parameters()])
    for _, weights, _ in ranks:
        torch.testing.assert_close(weights, flat, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- on a GPU

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_captured_step_on_a_gpu_matches_the_eager_step(tmp_path, era5_root):
    for amp in ("none", "bf16", "fp16"):
        eager = _train(NotingTrainer, era5_root, tmp_path / f"eager-{amp}", 8, amp_mode=amp)
        cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                           dict(TINY_VIT, data_root=era5_root, num_iters="8", amp_mode=amp,
                                expdir=str(tmp_path / f"graph-{amp}")))
        graph = NotingGraphTrainer(cfg, setup_runtime(cfg))  # the real CudaGraphOps
        graph.fit()
        assert graph.step_graph.captured and graph.device.type == "cuda"
        tol = 1e-4 if amp == "none" else 5e-2
        torch.testing.assert_close(graph.losses, eager.losses, rtol=tol, atol=tol,
                                   msg=lambda m: f"amp {amp}: {m}")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("loader", ["workers", "dali"])
def test_capture_with_loader_threads_running(tmp_path, era5_root, loader):
    """The capture happens while the loader's threads make CUDA calls: the pin-memory thread of
    2 worker processes, or DALI's threads."""
    over = {"num_data_workers": 2}
    if loader == "dali":
        pytest.importorskip("nvidia.dali", reason="DALI is not installed")
        over["data_loader_config"] = "dali-lowmem"
    eager = _train(NotingTrainer, era5_root, tmp_path / "eager", 8, **over)
    cfg = build_config(f"{ROOT}/config/ViT.yaml", "quickstart",
                       dict(TINY_VIT, data_root=era5_root, num_iters="8",
                            expdir=str(tmp_path / "graph"), **{k: str(v) for k, v in over.items()}))
    graph = NotingGraphTrainer(cfg, setup_runtime(cfg))
    graph.fit()
    assert graph.step_graph.captured and graph.step_graph.ops.__class__ is CudaGraphOps
    torch.testing.assert_close(graph.losses, eager.losses, rtol=1e-4, atol=1e-4)
