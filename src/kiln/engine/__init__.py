"""The engine: the front end (``AsyncLLM``, ``LLMEngine``'s ``Frontend``, input and output
processing) and the engine core's loop, process and client. The messages between them are in
``kiln.messages``.
"""
