"""What this machine offers for distributed training: versions, GPUs, interconnect, CPU cores, backends, and the
SLURM allocation it runs in, if any.

Everything is read locally and nothing fails: what cannot be detected (NVLink without ``nvidia-smi``, InfiniBand
without ``/sys/class/infiniband``) is reported as ``None`` (unknown) rather than guessed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_fastdist.diagnostics.slurm_allocation import SlurmAllocation

INFINIBAND_DIR = Path("/sys/class/infiniband")
NVIDIA_SMI_TIMEOUT_S = 10


@dataclass(frozen=True)
class GPU:
    """One visible GPU (``name`` as ``torch.cuda.get_device_name`` reports it)."""

    index: int
    name: str
    memory_bytes: int
    bf16: bool


@dataclass(frozen=True)
class Environment:
    """A snapshot of the machine.

    Attributes:
        cuda_version: the CUDA version torch was built with, or ``None`` (CPU build).
        nccl_version: ``"major.minor.patch"``.
        nvlink: from ``nvidia-smi topo -m``.
        infiniband_devices: names under ``/sys/class/infiniband`` (``None`` if the directory is missing).
        cpu_cores: cores this process may run on.
        backends: the torch.distributed backends available (``nccl``, ``gloo``, ``mpi``, ``ucc``).
        slurm: the SLURM allocation this process runs in (a batch script, ``salloc``'s shell, an ``srun`` task).
    """

    torch_version: str
    lightning_version: str | None
    cuda_version: str | None
    nccl_version: str | None
    gpus: list[GPU] = field(default_factory=list)
    nvlink: bool | None = None
    infiniband_devices: list[str] | None = None
    cpu_cores: int = 1
    host_memory_bytes: int | None = None
    backends: list[str] = field(default_factory=list)
    cpu_bf16_autocast: bool = False
    slurm: SlurmAllocation | None = None

    def as_dict(self) -> dict:
        """Plain data for JSON."""
        return asdict(self)


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpus() -> list[GPU]:
    if not torch.cuda.is_available():
        return []
    properties = [torch.cuda.get_device_properties(index) for index in range(torch.cuda.device_count())]
    # Ampere (compute capability 8) and newer compute in bf16.
    return [GPU(index=i, name=p.name, memory_bytes=p.total_memory, bf16=p.major >= 8) for i, p in enumerate(properties)]


def _nvlink() -> bool | None:
    """Whether ``nvidia-smi topo -m`` shows an NVLink (``NV<n>``) connection between GPUs."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        topology = subprocess.run([tool, "topo", "-m"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return re.search(r"\bNV\d+\b", topology.stdout) is not None if topology.returncode == 0 else None


def _infiniband_devices() -> list[str] | None:
    return sorted(entry.name for entry in INFINIBAND_DIR.iterdir()) if INFINIBAND_DIR.is_dir() else None


def cpu_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def host_memory_bytes() -> int | None:
    """Physical memory of the machine in bytes, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _backends() -> list[str]:
    if not dist.is_available():
        return []
    return [name for name in ("nccl", "gloo", "mpi", "ucc") if getattr(dist, f"is_{name}_available", lambda: False)()]


def cpu_bf16_autocast_available() -> bool:
    """Whether bfloat16 autocast runs on the CPU (a tiny matmul comes out in bfloat16)."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    except RuntimeError:
        return False


def bf16_available(device_type: str) -> bool:
    """Whether a run on ``device_type`` (``"cuda"`` or ``"cpu"``) can compute in bfloat16 mixed precision."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return cpu_bf16_autocast_available()
    return False


def detect_environment() -> Environment:
    """Read the machine (see :class:`Environment`); never raises for a missing tool or device."""
    return Environment(
        torch_version=torch.__version__,
        lightning_version=_package_version("lightning"),
        cuda_version=torch.version.cuda,
        nccl_version=_nccl_version(),
        gpus=_gpus(),
        nvlink=_nvlink(),
        infiniband_devices=_infiniband_devices(),
        cpu_cores=cpu_cores(),
        host_memory_bytes=host_memory_bytes(),
        backends=_backends(),
        cpu_bf16_autocast=cpu_bf16_autocast_available(),
        slurm=SlurmAllocation.from_environment(),
    )
