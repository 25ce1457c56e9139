"""Speculative decoding: proposers draft tokens, the model verifies them in one forward, and a
rejection sampler keeps exactly the model's output distribution.

The parts (``interface``: the contracts a platform may replace through ``device.proposer_cls`` and
``device.rejection_sampler_cls``; ``ngram``: prompt lookup; ``draft_model``: a smaller model
with its own KV cache; ``rejection_sampler``; ``verify``:
logits positions and per-position sampling metadata; ``speculator``: the model runner's
speculative part, which drives them over its persistent batch) know nothing about scheduling:
token ids, arrays and tensors in, token ids out. The scheduler gives each decoding request
``1 + k`` tokens (its last token and ``k`` drafts); the runner verifies them and proposes the next
drafts in the same step (``ModelRunnerOutput.spec_token_ids``).
"""
