"""What --fsdp is refused with, in one line each (exit 2), and its mixed-precision policy.
Training under FSDP on gloo ranks is tests/test_fsdp.py."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from engine.cuda_graph import check_can_capture
from engine.parallelism import mixed_precision_policy
from settings.errors import ConfigError
from settings.parse import build_config

VIT_YAML = os.path.join(ROOT, "config", "ViT.yaml")


@pytest.mark.parametrize("overrides,words", [
    (dict(noddp="true"), "drop one of --fsdp and --noddp"),
    (dict(amp_mode="fp16"), "use --amp_mode bf16"),
])
def test_fsdp_combinations_refused_with_the_fix(overrides, words):
    with pytest.raises(ConfigError, match=words):
        build_config(VIT_YAML, "quickstart", dict(fsdp="true", **overrides))


def test_train_graph_refuses_fsdp():
    cfg = build_config(VIT_YAML, "quickstart", dict(fsdp="true"))
    with pytest.raises(ConfigError, match="run train.py with --fsdp"):
        check_can_capture(cfg, torch.device("cuda"), model_parallel=False)


def test_fsdp_error_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--fsdp", "--noddp",
                        "--expdir", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--noddp" in lines[0], p.stderr


def test_mixed_precision_policy_follows_amp_mode():
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    none = mixed_precision_policy("none")
    assert none.param_dtype is None and none.reduce_dtype is None


def test_mp_fsdp_config_is_fsdp_over_tensor_parallel_in_bf16():
    c = build_config(VIT_YAML, "mp_fsdp")
    assert (c.fsdp, c.tensor_parallel, c.amp_mode, c.embed_dim) == (True, 2, "bf16", 1536)
