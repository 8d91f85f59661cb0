"""The container recipes, checked without building them (their base images come from
registries that this test cannot reach): every file they copy exists and reaches the build
context, they install only what the requirements files pin, they run as an unprivileged user,
their command is a script of the repository, and .dockerignore keeps local state out.
Also submit_pm.sh's podman runtime and the settings it exports for every rank."""
import importlib.metadata
import json
import os
import re
import shlex
import subprocess

import pytest
from packaging.requirements import Requirement

from conftest import ROOT
from test_launch import WRAPPER, rank_record, stubs, submit, write_exe  # noqa: F401

GPU, CPU = "docker/Dockerfile", "docker/Dockerfile.cpu"
DOCKERFILES = [GPU, CPU]
# Left to the GPU base image, which ships torch and the numpy it was built with.
FROM_BASE_IMAGE = {"torch", "numpy"}


def instructions(dockerfile):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, current = [], ""
    with open(os.path.join(ROOT, dockerfile)) as f:
        for line in f.read().splitlines():
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            if s.endswith("\\"):
                current += s[:-1] + " "
                continue
            word, _, rest = (current + s).partition(" ")
            out.append((word.upper(), rest.strip()))
            current = ""
    return out


def args_of(dockerfile, name):
    return [a for i, a in instructions(dockerfile) if i == name]


def copies(dockerfile):
    """[(sources, destination)] of every COPY, options dropped."""
    out = []
    for a in args_of(dockerfile, "COPY"):
        words = [w for w in shlex.split(a) if not w.startswith("--")]
        out.append((words[:-1], words[-1]))
    return out


def pip_requirement_files(dockerfile):
    """The requirements files `pip install -r` reads, as paths of the repository; fails on any
    package named on the command line instead of in a file."""
    staged = {os.path.join(dst, os.path.basename(src)): src
              for srcs, dst in copies(dockerfile) for src in srcs}
    files = []
    for run in args_of(dockerfile, "RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if "install" not in words or "pip" not in words:
                continue
            rest = iter(words[words.index("install") + 1:])
            for w in rest:
                if w in ("-r", "--requirement"):
                    files.append(staged[next(rest)])
                elif w in ("--index-url", "--extra-index-url", "-c", "--constraint"):
                    next(rest)
                else:
                    assert w.startswith("-"), f"{dockerfile} installs {w!r} outside the files"
    return files


def requirements(path, seen=None):
    """Requirement objects of a requirements file, following its -r lines."""
    out = []
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if line.startswith("-r "):
                out += requirements(os.path.join(os.path.dirname(path), line[3:].strip()))
            else:
                assert not line.startswith("-"), f"{path}: option {line!r}"
                out.append(Requirement(line))
    return out


def is_pinned(req):
    return [s.operator for s in req.specifier] == ["=="]


def dockerignore_patterns():
    out = []
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        for line in f:
            s = line.strip()
            if s and not s.startswith("#"):
                negate = s.startswith("!")
                out.append((negate, pattern_regex(s.lstrip("!"))))
    return out


def pattern_regex(pattern):
    """A .dockerignore pattern as a regular expression over paths relative to the context."""
    p, out, i = pattern.strip("/"), "", 0
    while i < len(p):
        if p.startswith("**/", i):
            out, i = out + "(.*/)?", i + 3
        elif p.startswith("**", i):
            out, i = out + ".*", i + 2
        elif p[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif p[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(p[i]), i + 1
    return re.compile(out + "$")


def ignored(rel, patterns):
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    out = False
    for negate, regex in patterns:
        if any(regex.match(c) for c in candidates):
            out = not negate
    return out


def build_context(patterns):
    """{path: size} of what `docker build .` sends from the repository root."""
    out = {}
    for d, dirs, files in os.walk(ROOT):
        rel_dir = os.path.relpath(d, ROOT)
        rel = (lambda n: n) if rel_dir == "." else (lambda n: f"{rel_dir}/{n}")
        dirs[:] = [n for n in dirs if not ignored(rel(n), patterns)]
        for n in files:
            if not ignored(rel(n), patterns) and os.path.isfile(os.path.join(d, n)):
                out[rel(n)] = os.path.getsize(os.path.join(d, n))
    return out


def tracked_files():
    """The repository's files: git's list in a checkout; inside an image built from these
    recipes (no .git there), the files of the copy."""
    if os.path.isdir(os.path.join(ROOT, ".git")):
        r = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True)
        return [p for p in r.stdout.splitlines() if os.path.exists(os.path.join(ROOT, p))]
    return list(build_context(dockerignore_patterns()))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_file_exists_and_reaches_the_build_context(dockerfile):
    patterns = dockerignore_patterns()
    sources = [s for srcs, _ in copies(dockerfile) for s in srcs]
    assert "." in sources, "the image holds a copy of the repository"
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), f"{dockerfile} copies missing {src}"
        assert src == "." or not ignored(src, patterns), f".dockerignore drops {src}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_installs_only_what_the_requirements_files_pin(dockerfile):
    files = pip_requirement_files(dockerfile)
    reqs = [r for f in files for r in requirements(f)]
    names = {r.name.lower() for r in reqs}
    assert {"h5py", "pyyaml", "tensorboard", "nvtx", "numpy", "torch"} <= names
    if dockerfile == GPU:
        assert "nvidia-dali-cuda120" in names
    loose = names - {r.name.lower() for r in reqs if is_pinned(r)}
    if dockerfile == GPU:
        assert loose == FROM_BASE_IMAGE
        for r in reqs:
            if r.name in FROM_BASE_IMAGE:
                assert all(s.operator == ">=" for s in r.specifier), r
    else:
        # The CPU image also pins torch; only numpy and the test tools float.
        assert "torch" not in loose and loose <= {"numpy", "pytest", "hypothesis", "nbformat",
                                                  "nbclient", "ipykernel", "matplotlib",
                                                  "pytest-xdist"}


def test_the_pins_are_the_versions_tested_here():
    pinned = [r for f in ("requirements-cpu.txt", "requirements-dali.txt")
              for r in requirements(f) if is_pinned(r) and (r.marker is None or
                                                            r.marker.evaluate())]
    assert {r.name for r in pinned} >= {"torch", "h5py", "pyyaml", "tensorboard", "nvtx",
                                        "nvidia-dali-cuda120"}
    for r in pinned:
        installed = importlib.metadata.version(r.name).split("+")[0]
        assert r.specifier.contains(installed), f"{r} but {installed} is installed"


def test_gpu_image_builds_on_the_nvidia_pytorch_container():
    base = [a for a in args_of(GPU, "ARG") if a.startswith("BASE_IMAGE=")]
    assert len(base) == 1 and re.fullmatch(r"BASE_IMAGE=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3",
                                           base[0])
    assert args_of(GPU, "FROM") == ["${BASE_IMAGE}"]


# The torch of NGC PyTorch releases (NVIDIA's release notes): a pre-release of the version it
# names, which counts as that version (2.6.0a0 as 2.6). docker/README.md shows the same table.
NGC_TORCH = {"24.08": "2.5.0a0", "24.10": "2.5.0a0", "24.12": "2.6.0a0", "25.01": "2.6.0a0"}


def torch_floor():
    """The torch specifier of requirements.txt, e.g. >=2.5, and its version."""
    torch_req, = [r for r in requirements("requirements.txt") if r.name == "torch"]
    lower = [s.version for s in torch_req.specifier if s.operator == ">="]
    assert len(lower) == 1, torch_req
    return torch_req.specifier, lower[0]


def test_gpu_base_image_torch_meets_the_requirements_floor():
    from packaging.version import Version

    spec, floor = torch_floor()
    base, = [a.split("=", 1)[1] for a in args_of(GPU, "ARG") if a.startswith("BASE_IMAGE=")]
    release = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3", base).group(1)
    assert release in NGC_TORCH, f"{base}: add its torch version to NGC_TORCH"
    torch_version = NGC_TORCH[release]
    assert spec.contains(Version(torch_version).base_version), \
        f"{base} ships torch {torch_version}, below requirements.txt's torch{spec}"
    # the recipe's comments name the floor and what the default release ships
    text = open(os.path.join(ROOT, GPU)).read()
    assert f"torch >= {floor}" in text and f"NGC release {release}" in text
    assert f"PyTorch {torch_version}" in text
    # and docker/README.md's table matches this one, default included
    readme = open(os.path.join(ROOT, "docker", "README.md")).read()
    rows = dict(re.findall(r"^\| (\d\d\.\d\d)\b[^|]*\| +(\S+) +\|$", readme, re.M))
    assert rows == NGC_TORCH
    assert f"nvcr.io/nvidia/pytorch:{release}-py3" in readme and f"torch>={floor}" in readme


def test_ngc_torch_table_counts_pre_releases_as_their_release():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    meets = {r for r, v in NGC_TORCH.items() if SpecifierSet(">=2.6").contains(Version(v).base_version)}
    assert meets == {"24.12", "25.01"}
    assert all(SpecifierSet(">=2.5").contains(Version(v).base_version) for v in NGC_TORCH.values())
    assert not SpecifierSet(">=2.5").contains("2.5.0a0")  # why base_version: a0 is below 2.5


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_runs_the_entry_script_as_an_unprivileged_user(dockerfile):
    steps = instructions(dockerfile)
    user = args_of(dockerfile, "USER")[-1]
    assert user not in ("root", "0")
    assert any(re.search(rf"\buseradd\b.*\b{user}$", a) for a in args_of(dockerfile, "RUN"))
    copy_repo = next(i for i, (name, a) in enumerate(steps) if name == "COPY" and
                     shlex.split(a)[-2] == ".")
    assert f"--chown={user}:{user}" in steps[copy_repo][1]
    assert steps.index(("USER", user)) > copy_repo
    destination = shlex.split(steps[copy_repo][1])[-1]
    assert args_of(dockerfile, "WORKDIR")[-1] == destination
    command = json.loads(args_of(dockerfile, "CMD")[-1])
    assert command[0] == "python" and command[1] in tracked_files()
    assert not ignored(command[1], dockerignore_patterns())


def test_dockerignore_keeps_local_state_out_and_the_code_in():
    patterns = dockerignore_patterns()
    for local in (".venv", ".git", "data", "logs", "runs", "data/era5/train/2016.h5",
                  "engine/__pycache__", "tests/__pycache__/x.pyc", ".pytest_cache",
                  "slurm-dl-train-42.out"):
        assert ignored(local, patterns), local
    kept = [p for p in tracked_files() if ignored(p, patterns)]
    assert not kept, f".dockerignore drops files of the repository: {kept}"
    context = build_context(patterns)
    assert "train.py" in context and "example_logs/quickstart/quickstart/1/vit/config.yaml" in context
    assert sum(context.values()) < 20e6, sorted(context.items(), key=lambda kv: -kv[1])[:5]


def test_docker_readme_commands_name_the_recipes():
    text = open(os.path.join(ROOT, "docker", "README.md")).read()
    for command in ("docker build -f docker/Dockerfile -t", "docker build -f docker/Dockerfile.cpu",
                    "podman-hpc build -f docker/Dockerfile", "podman-hpc migrate",
                    "shifterimg pull", "apptainer build", "SHIFTER_IMAGE=", "PODMAN_IMAGE=",
                    "APPTAINER_IMAGE="):
        assert command in text, command


# ------------------------------------------------------------- submit_pm.sh with containers

RANK_ENV = """import json, os
keys = ("HDF5_USE_FILE_LOCKING", "FI_MR_CACHE_MONITOR", "RANK")
with open(os.path.join(os.environ["STUB_OUT"], f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
"""


def test_submit_exports_file_locking_and_network_settings(stubs, tmp_path):  # noqa: F811
    script = tmp_path / "rank_env.py"
    script.write_text(RANK_ENV)
    r = submit(stubs, [], SCRIPT=str(script))
    assert r.returncode == 0, r.stderr
    env = json.loads((stubs["out"] / "env1.json").read_text())
    assert env == {"HDF5_USE_FILE_LOCKING": "FALSE", "FI_MR_CACHE_MONITOR": "userfaultfd",
                   "RANK": "1"}
    r = submit(stubs, [], SCRIPT=str(script), HDF5_USE_FILE_LOCKING="TRUE")
    assert json.loads((stubs["out"] / "env0.json").read_text())["HDF5_USE_FILE_LOCKING"] == "TRUE"


@pytest.mark.parametrize("runtime", ["podman-hpc", "podman"])
def test_submit_in_a_podman_image(stubs, runtime):  # noqa: F811
    write_exe(stubs["bin"] / runtime, WRAPPER.format(name=runtime))
    r = submit(stubs, ["--config", "a b"], SLURM_GPUS_ON_NODE="4", SCRATCH="/pscratch/u",
               PODMAN_IMAGE="dl-at-scale:gpu", PODMAN_ARGS="--nccl -v /cfs:/cfs")
    assert r.returncode == 0, r.stderr
    args = (stubs["out"] / f"{runtime}.args").read_text().splitlines()
    head = args[:args.index("bash")]
    assert head[:7] == ["run", "--rm", "--net", "host", "-v", f"{ROOT}:{ROOT}", "-w"]
    assert ["-v", "/pscratch/u:/pscratch/u"] == head[8:10]
    passed = {head[i + 1] for i, a in enumerate(head) if a == "-e"}
    assert {"SLURM_*", "EXPDIR", "ERA5_DATA_ROOT", "HDF5_USE_FILE_LOCKING", "FI_*"} <= passed
    # the GPU order that export_DDP_vars.sh applies in each rank (see tests/test_launch.py)
    assert {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "DDP_GPU_ORDER"} <= passed
    # the compile caches' folder (TORCHINDUCTOR_CACHE_DIR) and the tutorial's TF32 experiment
    assert {"TORCH*", "PYTORCH_*", "NVIDIA_TF32_OVERRIDE"} <= passed
    assert ("--gpu" in head) == (runtime == "podman-hpc")
    assert head[-4:] == ["--nccl", "-v", "/cfs:/cfs", "dl-at-scale:gpu"]
    assert rank_record(stubs, 1)["argv"] == ["--run_num", "job42", "--config", "a b"]


def test_submit_refuses_two_images_and_a_missing_podman(stubs):  # noqa: F811
    r = submit(stubs, [], SHIFTER_IMAGE="a", PODMAN_IMAGE="b")
    assert r.returncode == 1 and "SHIFTER_IMAGE PODMAN_IMAGE are set: choose one" in r.stderr
    r = submit(stubs, [], PODMAN_IMAGE="b", PATH=str(stubs["bin"]))  # whatever /usr/bin holds
    assert r.returncode == 1 and "neither podman-hpc nor podman is installed" in r.stderr
