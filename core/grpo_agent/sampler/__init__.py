"""sampler."""
