"""ssmquant: low-precision storage of the recurrent state of SSM layers (Mamba-2, Gated DeltaNet, Kimi Delta
Attention) in hybrid LLMs: measure it against the serving kernels' arithmetic, calibrate it, export it.

The package's layers, from the bottom (ARCHITECTURE.md): formats, kinds, replay, engines, kernels, simulate,
models, analysis / report / evaluate / calibrate, export, cli.
"""

__version__ = "0.1.0"
