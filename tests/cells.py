"""Code that cells of the resize and recovery tests share (run on the engines, as text)."""

# each rank's batch ``k``: its own seed, so that the ranks' batches differ and a one-process
# reference can make every rank's batch too
BATCH = """def batch(r, k):
    g = torch.Generator().manual_seed(1000 * k + r)
    X = torch.randn(16, 8, generator=g)
    return X, X.sum(dim=1, keepdim=True)
"""
