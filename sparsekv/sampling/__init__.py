"""Token sampling: per-step batch tensors, logits processors and the sampler."""

from sparsekv.sampling.batch import SamplingBatch
from sparsekv.sampling.sampler import Sampler, SamplerOutput

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch"]
