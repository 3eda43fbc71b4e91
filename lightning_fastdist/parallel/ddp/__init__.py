"""What DDP does to gradients: comm hooks by name (fp16, bf16, PowerSGD), ``comm_hook: auto``, bucket sizes."""
