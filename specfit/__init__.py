"""SpecFit: throughput-optimal speculative decoding for MoE models with offloaded experts."""

__version__ = "0.1.0"
