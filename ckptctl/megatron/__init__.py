"""Megatron-Core and Megatron-FSDP rules: fused row geometry, TP kinds, optimizer buckets, parameter names. Pure."""
