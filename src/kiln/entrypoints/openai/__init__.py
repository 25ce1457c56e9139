"""The OpenAI-compatible server (``kiln serve``): FastAPI routes over ``AsyncLLM``.

``api_server`` (app, routes, lifecycle), ``protocol`` (request models), ``serving_*`` (one class
per route family), ``errors`` (OpenAI error bodies), ``metrics`` (Prometheus), ``cli_args``
(flags). Importing this package imports nothing else, so ``kiln --help`` stays fast.
"""
