"""train.py with the training step captured once as a CUDA graph and replayed (GPU only).

    python train_graph.py --config short --amp_mode bf16
    python train_graph.py --yaml_config config/UNet.yaml --config short --enable_fused
    torchrun --nproc_per_node 4 train_graph.py --config bs64_opt

The same engine, configs, loaders, logs and checkpoints as train.py (a checkpoint of either
resumes in the other); how the step is captured: docs/performance.md, "CUDA graphs".
"""
import logging
import os
import sys

# Capturing DDP's NCCL all-reduce needs torch's asynchronous NCCL error handling off, before the
# process group starts; a value the user set is kept (the log says which the run has).
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_ERROR_HANDLING_GIVEN = NCCL_ERROR_HANDLING in os.environ
os.environ.setdefault(NCCL_ERROR_HANDLING, "0")

from settings.cli import from_argv

if __name__ == "__main__":  # bad settings and --help are answered before torch loads
    COMMAND_LINE_CONFIG = from_argv(sys.argv[1:], prog="train_graph.py")

from train import Trainer, run
from engine.cuda_graph import CudaGraphOps, StepGraph, capture_warmup_steps, check_can_capture
from settings.errors import ConfigError

log = logging.getLogger("train")


class GraphTrainer(Trainer):
    captures_step = True  # capturable Adam with a tensor learning rate; autocast without cache

    def __init__(self, cfg, rt, ending=None, ops=None):  # ops: a stand-in in CPU tests
        if getattr(cfg, "rollout_max", 1) > 1:
            raise ConfigError(f"rollout of {cfg.rollout_max} steps is not captured as a CUDA "
                              f"graph: train with train.py")
        if ops is None:
            check_can_capture(cfg, rt.device, model_parallel=rt.groups is not None)
            ops = CudaGraphOps(rt.device)
        ddp = rt.dp_size > 1 and not cfg.noddp
        warmup = capture_warmup_steps(cfg, ddp)  # refused here, before anything is written
        with ops.side_stream():  # DDP is wrapped on the stream the step is captured on
            super().__init__(cfg, rt, ending)
        if warmup != cfg.graph_warmup_steps:
            log.info(f"CUDA graph: {warmup} eager warm-up steps (graph_warmup_steps="
                     f"{cfg.graph_warmup_steps}; DDP needs at least 11 before capture)")
        value = os.environ.get(NCCL_ERROR_HANDLING, "")
        source = "from the environment" if NCCL_ERROR_HANDLING_GIVEN else "set by train_graph.py"
        log.info(f"{NCCL_ERROR_HANDLING}={value} ({source})" + (
            "; capturing DDP's NCCL all-reduce needs 0" if ddp and value != "0" else ""))
        capture_at = self.iteration + warmup  # the step that is captured, in this launch
        self.run_log.keep_out_of_trace(capture_at)  # no torch.profiler window over the capture
        self.step_graph = StepGraph(self.update, lambda: self.optimizer.zero_grad(set_to_none=True),
                                    ops, warmup)

    def train_step(self, x, y, probe):
        loss, grad_norm = self.step_graph(x, y, probe)
        self.scheduler.step()  # fills the learning-rate tensor the captured update reads
        return loss, grad_norm

    def measured_memory(self) -> bool:
        return self.step_graph.last_mode == "eager"  # a replay is not measured step by step


if __name__ == "__main__":
    run(COMMAND_LINE_CONFIG, GraphTrainer)
