"""Mixed precision: the layers that train in fp8 (torchao), optimizers switched to their fused step."""
