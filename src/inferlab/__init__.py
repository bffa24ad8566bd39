"""inferlab: an LLM inference engine, an OpenAI-compatible server, and the tools to measure them.

    from inferlab import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)

Imports are lazy so that `inferlab bench` and `inferlab plan` never pay for torch.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from inferlab.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput"):
        from inferlab.engine import request

        return getattr(request, name)
    raise AttributeError(f"module 'inferlab' has no attribute {name!r}")
