"""paratrain: distributed PyTorch training, correct by construction."""
__version__ = "0.1.0"
