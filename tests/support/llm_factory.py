"""LLMFactory: builds numaserve.LLM engines for a test or a module and closes every one it built when that
scope ends (tests/conftest.py's `make_llm` and `module_llm`): no engine's loop thread outlives its tests."""

import numaserve as ns


class LLMFactory:
    def __init__(self):
        self._built: list[ns.LLM] = []

    def __call__(self, model, **engine) -> ns.LLM:
        """ns.LLM(model, **engine), closed with the factory."""
        llm = ns.LLM(model, **engine)
        self._built.append(llm)
        return llm

    def close(self) -> None:
        while self._built:
            self._built.pop().close()
