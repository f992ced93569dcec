"""servelab: an LLM inference serving system you can run, measure and see inside."""
from servelab import compiled as _compiled

# The one place the compiled simulator modules are switched on (SERVELAB_COMPILED, see servelab/compiled):
# before anything else of servelab is imported, so what a process runs never depends on its import order.
_compiled.install()

from servelab.sampling_params import SamplingParams  # noqa: E402
from servelab.outputs import CompletionOutput, RequestOutput  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import servelab` stays light for the lab and the CLI.
    if name == "LLM":
        from servelab.llm import LLM
        return LLM
    raise AttributeError(name)
