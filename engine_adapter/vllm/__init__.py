"""vLLM: the tap on its engine client and output processor, CPU defaults, the default model.

Nothing here imports vLLM at module level: ``import engine_adapter.vllm`` is cheap and
works without vLLM installed.
"""
