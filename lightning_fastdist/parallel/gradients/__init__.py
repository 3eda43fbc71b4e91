"""Gradients: their norms whatever holds them (DDP, FSDP2's DTensors, ZeRO), and which parameters get them now."""
