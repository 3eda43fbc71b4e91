"""Measurement helpers with no Lightning dependency: host-sync counting, memory model, advisor."""
