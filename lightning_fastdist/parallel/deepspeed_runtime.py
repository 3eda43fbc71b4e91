"""DeepSpeed as an optional dependency that runs on CPU (gloo) and CUDA (NCCL) without compiling anything.

- :func:`import_deepspeed` imports it or says in one line how to install it.
- :func:`skip_jit_built_comm_ops`: DeepSpeed's communication backend loads a
  shared-memory all-reduce op (``deepspeed_shm_comm``) whenever its accelerator
  offers one (the CPU accelerator does), and loading means compiling C++ at the
  first ``init_distributed`` (about 75 s here, and an error without a compiler),
  although gloo carries every collective anyway. Marking the op incompatible
  makes DeepSpeed use ``torch.distributed`` alone.
- :func:`auto_bucket_size`: buckets no larger than the model.
- :func:`check_deepspeed_device`: DeepSpeed picks its accelerator once per process
  (CUDA when a GPU is visible); a Trainer on another device would have DeepSpeed
  put tensors where the model is not.

Ops that would still be compiled just in time: optimizers named in a DeepSpeed
``optimizer`` config section (``FusedAdam``, ``DeepSpeedCPUAdam``), NVMe offload
(``async_io``) and DeepSpeed's own kernels (inference, sparse attention). The
strategy uses the LightningModule's torch optimizer and none of these.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

INSTALL_HINT = "pip install lightning-fastdist[deepspeed]"
SHM_COMM_OP = "deepspeed_shm_comm"
MAX_AUTO_BUCKET = 200_000_000  # elements: Lightning's default bucket size, the cap of "auto"
MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters: gathered parameters kept at once


def deepspeed_available() -> bool:
    """Whether ``deepspeed`` can be imported (without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed(owner: str) -> ModuleType:
    """``import deepspeed``, or an ``ImportError`` naming ``owner`` and the install command."""
    if not deepspeed_available():
        raise ImportError(f"{owner} needs DeepSpeed, which is not installed: {INSTALL_HINT}")
    import deepspeed  # noqa: PLC0415 - optional

    return deepspeed


def auto_bucket_size(model: torch.nn.Module) -> int:
    """The ``"auto"`` bucket size: the trainable parameters, at most :data:`MAX_AUTO_BUCKET` elements.

    DeepSpeed allocates its buckets at full size on every micro-batch (one or two per bucket kind), so a
    bucket larger than the model only costs memory, and under ``deterministic=True`` the time to fill it.
    """
    return min(MAX_AUTO_BUCKET, sum(p.numel() for p in model.parameters() if p.requires_grad))


def skip_jit_built_comm_ops() -> None:
    """Keep DeepSpeed's communication backend from compiling its shared-memory op; call before ``init_distributed``."""
    import deepspeed.ops  # noqa: PLC0415 - optional

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def deepspeed_device_type() -> str:
    """The device type DeepSpeed's accelerator puts tensors on (``"cuda"``, ``"cpu"``, ...)."""
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 - optional

    return torch.device(get_accelerator().device_name()).type


def check_deepspeed_device(device: torch.device, owner: str) -> None:
    """Raise ``RuntimeError`` in one line if DeepSpeed's accelerator is not ``device``'s type."""
    chosen = deepspeed_device_type()
    if chosen != device.type:
        raise RuntimeError(
            f"{owner}: the Trainer runs on {device.type} but DeepSpeed chose its {chosen} accelerator; "
            f"set the environment variable DS_ACCELERATOR={device.type} before starting the run."
        )
