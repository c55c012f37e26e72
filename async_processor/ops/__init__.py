"""Operator tools: ``status``, ``dead-letters``, ``exporter`` and ``check-config --probe``."""
