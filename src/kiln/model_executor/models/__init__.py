"""Kiln's model definitions, written for the paged KV cache (see ``llama.py`` for the contract).

Importing this package imports no model: ``kiln.model_executor.registry`` resolves each
architecture's class lazily by its dotted path.
"""
