"""tuner: a Pareto autotuner for vLLM launch flags."""

__version__ = "0.1.0"
