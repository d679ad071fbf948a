"""Activation checkpointing with CPU offload. Filled in by later issues."""
