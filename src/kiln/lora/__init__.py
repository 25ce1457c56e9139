"""Multi-LoRA serving: PEFT adapters applied per request, several adapters and the base model in
one batch.

- ``request``: ``LoRARequest``, the adapter a request names (plain data, crosses processes).
- ``peft``: reading and checking a PEFT adapter folder against the model's shapes.
- ``model_manager``: the model runner's side: linear layers wrapped with adapter slots, and which
  adapter sits in which slot. The matmul is the ``lora_apply`` op
  (``kiln.model_executor.layers.lora``: punica's shrink and expand), which a platform can replace
  with its own kernel.

Importing this package costs nothing (the API server imports ``request`` through the messages).
"""
