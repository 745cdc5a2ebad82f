"""The Sampler's parts: logit adjustments, filters, counter-based noise, logprobs."""
