"""Sampling: batched per-step metadata and the sampler that turns logits into token ids."""

from kiln.sampling.metadata import SamplingMetadata, make_generator
from kiln.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_prompt_logprobs

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "make_generator",
]
