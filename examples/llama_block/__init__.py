"""A Llama-style decoder block whose kernels fibray traces, sweeps and substitutes.

`python -m examples.llama_block --workdir /tmp/llama` runs the whole loop on a small
block: trace it on sample prompts, sweep the candidates on the traced workloads with
the real Ray sweep, enable apply, and check the outputs against plain PyTorch.
"""
