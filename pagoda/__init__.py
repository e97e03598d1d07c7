"""pagoda: paged-KV LLM serving pods and the Kubernetes operator that runs them.

The offline API is re-exported here lazily, so `import pagoda` stays cheap (no torch import)
for the operator and the CLI's help.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagoda.server.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagoda.server.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
