"""ssmquant: low-precision storage of SSM recurrent state (Mamba-2, Gated DeltaNet) in hybrid LLMs."""

__version__ = "0.1.0"
