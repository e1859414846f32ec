"""Parallel runtime: the sharded train step (data, tensor and, later, pipeline parallel) and ZeRO."""
