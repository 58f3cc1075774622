"""The built-in reward server: math answers checked against gold answers, over HTTP.

As a process (what podagent's head starts; flags or PODAGENT_REWARD_* variables):

    python -m podagent.rewards --host 10.0.0.2 --port 5000 [--workers N] [--dataset FILE]
    podagent reward-server ...                  # the same command

In a program:

    from podagent.rewards import settings, server
    s = settings.build({"host": "10.0.0.2"})    # flags > environment > defaults; ConfigError
    server.serve(s)                             # blocks until SIGTERM/SIGINT, returns 0
    async with server.running(s) as r: ...      # inside your own event loop; r.url, r.scorer

Scoring one response without a server: `verify.score(response, gold, verify.Verifier())`.
"""
