"""The device table: what a device kind means for torch, Ray and the environment.

    python -m grpo_pipeline --model tiny --device cpu --dry-run    # the `platform` section of the profile

One `Platform` per kind, filled from `profiles/devices/<kind>.yaml`. Code asks the platform (its
torch device, dtype, Ray resource, process-group backend, visible-devices variable) instead of
branching on the kind, so a new kind of device is a new YAML file, not edits across the stages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grpo_pipeline.profiles.section import MAX_GIB, MAX_RATE, Section

DeviceKind = Literal["gpu", "npu", "cpu"]
# Ray's own accelerator resource; any other device resource is a custom one (`ray start --resources`).
RAY_BUILTIN_GPU = "GPU"


class Accelerator(Section):
    """One model of device: what the memory planner and its layout cost model know of it
    (planner/memory.py, planner/layouts.py). Bandwidths are per device, one direction."""

    memory_gib: float = Field(..., gt=0, le=MAX_GIB, description="Device memory as torch reports it (total_memory), GiB.")
    bf16_tflops: float = Field(..., gt=0, le=MAX_RATE, description="Dense bf16 peak, TFLOP/s.")
    link_gb_s: float = Field(..., gt=0, le=MAX_RATE, description="Bandwidth to the other devices of its node (NVLink, HCCS), GB/s.")
    network_gb_s: float = Field(..., gt=0, le=MAX_RATE, description="Bandwidth to other nodes (InfiniBand, RoCE), GB/s.")
    host_gb_s: float = Field(..., gt=0, le=MAX_RATE, description="Bandwidth to host memory (PCIe), GB/s: what offloading moves over.")


class Platform(Section):
    """Facts about a device kind. They live in `profiles/devices/<kind>.yaml`, never in code branches."""

    kind: DeviceKind = Field("cpu", description="Device kind this platform describes.")
    torch_device: Literal["cpu", "cuda", "npu"] = Field(
        "cpu", description="torch's name for the device (`cuda` for NVIDIA GPUs, `npu` with torch_npu)."
    )
    dtype: Literal["float32"] | None = Field(
        None,
        description="Dtype every model runs in on this device, whatever engine.dtype says (CPUs: float32, "
        "as bf16 kernels there are slow or missing); empty: engine.dtype.",
    )
    device_noun: str = Field("CPU cores", description="What one unit of this device is called in messages.")
    comm_backend: Literal["nccl", "hccl", "gloo"] = Field(
        "gloo", description="torch.distributed backend the training workers use."
    )
    ray_resource: str | None = Field(
        None,
        description="Ray resource that counts one device (`GPU`, or the custom resource `NPU`); "
        "none on CPU, where a worker takes CPU cores.",
    )
    visible_devices_var: str | None = Field(
        None,
        description="Environment variable that selects the devices a process sees "
        "(`CUDA_VISIBLE_DEVICES`, `ASCEND_RT_VISIBLE_DEVICES`).",
    )
    container_image: str | None = Field(
        None, description="Container image known to run this platform's stack (verl, vLLM, drivers)."
    )
    driver_version_command: list[str] | None = Field(
        None, description="Command whose first output line is the device driver's version (detection reports it)."
    )
    toolkit_version_var: str | None = Field(
        None, description="Environment variable that holds the device toolkit's version (detection reports it)."
    )
    setup_fix: str | None = Field(
        None, description="What to do on a host whose torch has no support for this kind of device: the command "
        "that builds the project's environment for it (docs/install.md). A refused `--device` names it.")

    accelerator: str | None = Field(
        None, description="Model of device the run plans memory for: a key of `platform.accelerators` (e.g. `H20`, "
        "`H200`, `Atlas A3`); a detected device's name picks its row when it has one.")
    accelerators: dict[str, Accelerator] = Field(
        default_factory=dict, description="Known models of this kind of device, by name (memory, speed, links).")
    device_memory_gib: float | None = Field(
        None, gt=0, le=MAX_GIB, description="Memory of one device, GiB, overriding the accelerator's and the detected value.")
    reserved_memory_gib: float = Field(
        0.0, ge=0, le=MAX_GIB, description="Device memory outside the framework's allocator, per device, GiB: the runtime's "
        "context, communication buffers (NCCL/HCCL), allocator slack. The planner fits estimates into the rest.")
    host_memory_gib: float | None = Field(
        None, gt=0, le=64 * MAX_GIB, description="Host memory per node, GiB, that offloaded parameters and optimizer states must fit "
        "in; empty: not checked (unless detected on the host that runs training).")

    @model_validator(mode="after")
    def accelerator_is_known(self) -> Platform:
        if self.accelerator is not None and self.accelerator not in self.accelerators:
            known = ", ".join(self.accelerators) or "none"
            raise ValueError(
                f"platform.accelerator {self.accelerator!r} has no row in platform.accelerators (known: {known}); pick "
                "one of them, or add its row (memory_gib, bf16_tflops, link_gb_s, network_gb_s, host_gb_s), or set "
                "platform.device_memory_gib for the memory plan")
        return self

    def accelerator_for(self, detected_names: list[str] | None = None) -> tuple[str | None, Accelerator | None]:
        """The row of `accelerators` for a detected device's name (the longest name it contains: 'NVIDIA
        H200' is an H200, not an H20), else `accelerator`'s."""
        for name in detected_names or []:
            if known := [key for key in self.accelerators if key.lower() in name.lower()]:
                key = max(known, key=len)
                return key, self.accelerators[key]
        return self.accelerator, self.accelerators.get(self.accelerator or "")

    def device_memory(self, detected_names: list[str] | None = None,
                      detected_gib: list[float] | None = None) -> tuple[str, float | None, str]:
        """(device, GiB of one device, where the number comes from): `device_memory_gib`, else what
        detection found on this host, else the accelerator's row."""
        name, spec = self.accelerator_for(detected_names)
        device = name or self.kind
        if self.device_memory_gib:
            return device, self.device_memory_gib, "platform.device_memory_gib"
        if detected_gib:
            return device, min(detected_gib), "detected on this host"
        if spec is not None:
            return device, spec.memory_gib, f"platform.accelerator {name}"
        return device, None, "unknown: set platform.device_memory_gib"

    @property
    def accelerated(self) -> bool:
        """A device other than the CPU does the work (vLLM and verl need one)."""
        return self.ray_resource is not None

    def run_dtype(self, engine_dtype: str) -> str:
        return self.dtype or engine_dtype

    def ray_task_options(self, cpus: int = 1, devices: int = 1) -> dict[str, Any]:
        """`ray.remote(...)` options that give a task `devices` devices (on CPU: `cpus` cores)."""
        if self.ray_resource is None:
            return {"num_cpus": cpus}
        if self.ray_resource == RAY_BUILTIN_GPU:
            return {"num_gpus": devices}
        return {"resources": {self.ray_resource: devices}}

    def ray_worker_resources(self, cpus_per_worker: int = 1) -> dict[str, float]:
        """What Ray holds for one training worker (the resources `ray_train_scaling` asks for)."""
        return {"CPU": cpus_per_worker} if self.ray_resource is None else {self.ray_resource: 1}

    def ray_train_scaling(self, cpus_per_worker: int = 1) -> dict[str, Any]:
        """Ray Train `ScalingConfig` fields that give each training worker one device."""
        if self.ray_resource is None:
            return {"use_gpu": False, "resources_per_worker": {"CPU": cpus_per_worker}}
        if self.ray_resource == RAY_BUILTIN_GPU:  # Ray Train also sets CUDA_VISIBLE_DEVICES per worker
            return {"use_gpu": True, "resources_per_worker": None}
        return {"use_gpu": False, "resources_per_worker": {self.ray_resource: 1}}
