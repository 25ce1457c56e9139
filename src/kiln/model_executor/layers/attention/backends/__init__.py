"""Attention backends that ship with Kiln: ``cpu`` (the reference platform's) and ``torch_ref``
(the dense reference every backend must match). Platforms name theirs by dotted path."""
