"""The Trainer settings FastDeepSpeedStrategy refuses before any process starts, each in one line: DeepSpeed runs mixed
precision itself, from ``Trainer(precision=...)``, and synchronises no BatchNorm, where Lightning's
``DeepSpeedStrategy`` would train something else than asked without a word.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import DeepSpeedPrecision


def refuse_settings_deepspeed_ignores(owner: str, precision_plugin: Any, layer_sync: Any) -> None:
    """Raise the one-line ``ValueError`` of a precision plugin or a ``sync_batchnorm`` DeepSpeed would not honour.

    Args:
        owner: the strategy's class name, which the line starts with.
        precision_plugin: the Trainer's (``Trainer(precision=...)`` makes a ``DeepSpeedPrecision``).
        layer_sync: the Trainer's ``sync_batchnorm`` plugin, or ``None``.
    """
    if not isinstance(precision_plugin, DeepSpeedPrecision):
        raise ValueError(
            f"{owner}: precision comes from Trainer(precision=...), which DeepSpeed runs itself; "
            f"remove the {type(precision_plugin).__name__} plugin."
        )
    if precision_plugin.precision == "16-true":  # Lightning's DeepSpeedStrategy trains something else
        raise ValueError(
            f"{owner}: precision='16-true' (fp16 weights, no loss scaling) is not what DeepSpeed's "
            "fp16 computes (fp32 master weights, a loss scaler that skips steps while it calibrates); use "
            "precision='16-mixed' (fp16 with loss scaling) or 'bf16-true'."
        )
    if layer_sync is not None:  # Lightning's DeepSpeedStrategy trains on with unsynchronised BatchNorm
        raise ValueError(
            f"{owner}: sync_batchnorm=True is not honoured by DeepSpeed's engine, which never "
            "converts BatchNorm layers; use FastDDPStrategy or FastFSDPStrategy, or remove sync_batchnorm."
        )
