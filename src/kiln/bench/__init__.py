"""What ``kiln bench`` runs: load generators that measure a running server from the outside.

Nothing here imports the engine: a benchmark talks HTTP to any OpenAI-compatible server (Kiln's,
vLLM's, llama.cpp's) and must give the same numbers whichever it is.
"""
