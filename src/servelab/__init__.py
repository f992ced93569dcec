"""servelab: an LLM inference serving system you can run, measure and see inside."""
from servelab.sampling_params import SamplingParams
from servelab.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import servelab` stays light for the lab and the CLI.
    if name == "LLM":
        from servelab.llm import LLM
        return LLM
    raise AttributeError(name)
