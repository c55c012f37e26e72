"""Admission control gates (queue level and pool level); see ``gates.base``.

Gate types register in ``gates.base.GATES``, which imports their modules at its first
lookup (``registry.Registry``).
"""
