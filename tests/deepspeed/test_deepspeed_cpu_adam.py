"""ZeRO-Offload's CPU step: DeepSpeed's CPU Adam where a CUDA run can build it, torch's optimizer otherwise.

Building the op takes about a minute and is only tried on CUDA runs, so the builds here are stand-ins;
what is tested for real is which optimizer the choice keeps, the line that says so, and that the
replacement shares the torch optimizer's parameter groups (its LR scheduler keeps steering them).
"""

from __future__ import annotations

import torch

from lightning_fastdist.parallel.deepspeed.runtime import (
    choose_offload_optimizer,
    cpu_adam_arguments,
    cpu_adam_obstacle,
)


def parameters() -> list[torch.nn.Parameter]:
    return list(torch.nn.Linear(4, 4).parameters())


def test_a_cpu_run_or_another_optimizer_or_option_keeps_torchs(monkeypatch):
    adamw = torch.optim.AdamW(parameters(), lr=1e-3)
    assert cpu_adam_obstacle(adamw, "cpu") == "a cpu run compiles nothing"
    sgd = torch.optim.SGD(parameters(), lr=0.1)
    assert "replaces torch's Adam and AdamW only, not SGD" in cpu_adam_obstacle(sgd, "cuda")
    amsgrad = torch.optim.Adam(parameters(), amsgrad=True)
    assert cpu_adam_obstacle(amsgrad, "cuda") == "amsgrad=True has no counterpart in DeepSpeed's CPU Adam"
    monkeypatch.setenv("CXX", "/no/such/compiler")
    assert cpu_adam_obstacle(adamw, "cuda") == "no C++ compiler to build it ('/no/such/compiler' not found; set CXX)"


def test_the_choice_says_which_optimizer_steps_and_why(monkeypatch):
    adamw = torch.optim.AdamW(parameters())
    kept, line = choose_offload_optimizer(adamw, "cpu")
    assert kept is adamw and line == "ZeRO-Offload: the CPU step runs torch's AdamW: a cpu run compiles nothing."

    monkeypatch.delenv("CXX", raising=False)  # this machine has c++ and ninja: only the build itself is a stand-in

    def fails(optimizer):
        raise RuntimeError("DeepSpeedCPUAdam requires the cpu_adam op, which failed to build/load.") from OSError(
            "cuda_runtime.h: No such file or directory\ncompilation terminated."
        )

    kept, line = choose_offload_optimizer(adamw, "cuda", build=fails)
    assert kept is adamw
    assert line == (
        "ZeRO-Offload: the CPU step runs torch's AdamW: DeepSpeed's CPU Adam did not build (DeepSpeedCPUAdam "
        "requires the cpu_adam op, which failed to build/load.: cuda_runtime.h: No such file or directory)."
    )
    replacement = torch.optim.Adam(adamw.param_groups)
    chosen, line = choose_offload_optimizer(adamw, "cuda", build=lambda optimizer: replacement)
    assert chosen is replacement and line.startswith("ZeRO-Offload: the CPU step runs DeepSpeed's CPU Adam in place")


def test_the_replacement_takes_the_same_step_settings_and_shares_the_groups_the_scheduler_steers():
    decay, no_decay = parameters(), parameters()
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95)
    )
    arguments = cpu_adam_arguments(adamw)
    assert arguments == dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, adamw_mode=True)
    assert cpu_adam_arguments(torch.optim.Adam(parameters(), weight_decay=0.1))["adamw_mode"] is False
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5 ** (step + 1))
    # DeepSpeedCPUAdam(adamw.param_groups, ...) goes through torch's Optimizer.__init__ as this does.
    replacement = torch.optim.Adam(adamw.param_groups, **{k: v for k, v in arguments.items() if k != "adamw_mode"})
    assert all(a is b for a, b in zip(replacement.param_groups, adamw.param_groups))
    adamw.step()  # no gradients: nothing moves; the scheduler's order check is kept
    scheduler.step()
    assert [group["lr"] for group in replacement.param_groups] == [1e-3 * 0.25] * 2
    assert [group["weight_decay"] for group in replacement.param_groups] == [0.1, 0.0]  # per group, as before
