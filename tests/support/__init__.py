"""Helpers the tests share: the multi-process harness, the emulated cluster, fault runs, model zoo, workloads."""
