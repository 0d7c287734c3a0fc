"""`omlx bench`: a scripted benchmark client for any OpenAI-compatible server (omlx or a peer).

prompts.py (seeded text sized in the model's tokens), client.py (timed SSE client, token
counting and memory over HTTP), workloads.py (the scenarios as steps of request bodies),
runner.py (interleaved runs, a managed omlx for restarts), report.py (spreads, ratios, table),
session.py (one invocation). This package talks HTTP only: it never imports omlx's server.
"""
