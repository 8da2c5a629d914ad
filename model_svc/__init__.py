"""Model service: weights, model code, the KV tensors of both pools, copy lists, the forward
pass over the paged cache, and sampling. It sees token ids only, never text."""
